"""Soak a running Flare server with mixed traffic for a bounded time, then report.

Traffic (each worker draws a kind per request from a seeded generator; weights in KINDS):
- stream: a streamed chat read to `[DONE]`;
- stream_abort: a streamed chat the client drops after 1-6 events (a disconnect);
- chat: a non-streamed chat, sometimes n=2;
- chat_abort: a non-streamed chat whose client gives up after 0.2-1.5 s (a disconnect);
- fork: two concurrent chats sharing a long conversation prefix, different last turns;
- completion: /v1/completions with a text prompt;
- bad: a request that must be refused with a 4xx (broken JSON, unknown model, wrong types,
  a prompt beyond the context, invalid UTF-8, a tool message without its call).

Printed at the end: requests by outcome, latency p50/p99 of completed requests (and TTFT
of streams), the server's resident memory over time (start, max, end), and the KV pool at
the end against the baseline taken before the traffic. Exit status 1 when a check fails:
any 5xx or in-stream server error, a bad request not refused with a 4xx, pages held by
requests after the traffic, requests still running or waiting, or RSS growth above
`--rss-bound-mb` between the end of the warm-up (`--warmup` s) and the end, less what the
host tier (which holds demoted KV pages up to its budget) grew meanwhile.

    .venv/bin/flare serve --embedded --cache-dir .cache/flare --num-pages 256 --port 8123 &
    .venv/bin/python bench/soak.py --url http://127.0.0.1:8123 --minutes 2

The server's PID (for RSS) is found from the listening port when `--pid` is not given
(psutil; the server must run on this machine). Not a test: bounded by `--minutes` and
`--max-requests`; every request has a client timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from soak_report import FAILURE_PREFIXES, Record, report

KINDS = {"stream": 25, "stream_abort": 20, "chat": 20, "chat_abort": 10, "fork": 8,
         "completion": 5, "bad": 12}
REQUEST_TIMEOUT_S = 180.0
TOPICS = ["the sea", "a robot", "Python lists", "prime numbers", "a small town", "tea",
          "the moon", "binary search", "a lost key", "autumn"]
FORK_PREFIX = [
    {"role": "system", "content": "You are a careful coding assistant. " * 8},
    {"role": "user", "content": "Here is a function:\n\ndef add(a, b):\n    return a + b\n" * 6},
    {"role": "assistant", "content": "It adds two numbers and returns the sum."},
]


@dataclass
class Soak:
    url: str
    model: str
    deadline: float
    max_requests: int
    records: list[Record] = field(default_factory=list)
    started: int = 0

    def take(self) -> bool:
        """Whether another request may start (time and count bounds)."""
        if time.monotonic() >= self.deadline or self.started >= self.max_requests:
            return False
        self.started += 1
        return True


# --------------------------------------------------------------------------- requests


def _chat_body(model: str, rng: random.Random, stream: bool, **extra: Any) -> dict:
    topic = rng.choice(TOPICS)
    return {"model": model, "stream": stream, "max_tokens": rng.randint(8, 64),
            "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randint(0, 2**31),
            "messages": [{"role": "user", "content": f"Tell me about {topic}."}], **extra}


def _error_event(line: str) -> str | None:
    """The error type of an SSE error event, else None."""
    payload = json.loads(line[len("data: "):])
    return payload["error"].get("type") or "error" if "error" in payload else None


async def do_stream(client: httpx.AsyncClient, s: Soak, rng: random.Random,
                    abort_after: int | None) -> Record:
    kind = "stream" if abort_after is None else "stream_abort"
    body = _chat_body(s.model, rng, True, stream_options={"include_usage": True})
    t0 = time.monotonic()
    ttft = None
    events = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return Record(kind, f"http_{r.status_code}", time.monotonic() - t0,
                          detail=r.text[:200])
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return Record(kind, "ok" if abort_after is None else "finished_before_abort",
                              time.monotonic() - t0, ttft)
            error = _error_event(line)
            if error:
                return Record(kind, f"stream_{error}", time.monotonic() - t0, detail=line[:200])
            events += 1
            if ttft is None and '"content":"' in line and '"content":""' not in line:
                ttft = time.monotonic() - t0
            if abort_after is not None and events >= abort_after:
                return Record(kind, "aborted", time.monotonic() - t0, ttft)
    return Record(kind, "stream_cut_without_done", time.monotonic() - t0)


async def do_chat(client: httpx.AsyncClient, s: Soak, rng: random.Random,
                  give_up_s: float | None) -> Record:
    kind = "chat" if give_up_s is None else "chat_abort"
    extra: dict[str, Any] = {"n": 2} if rng.random() < 0.2 else {}
    if give_up_s is not None:
        extra |= {"max_tokens": 200, "ignore_eos": True}
    body = _chat_body(s.model, rng, False, **extra)
    t0 = time.monotonic()
    try:
        r = await client.post("/v1/chat/completions", json=body,
                              timeout=give_up_s or REQUEST_TIMEOUT_S)
    except httpx.TimeoutException:
        if give_up_s is not None:
            return Record(kind, "aborted", time.monotonic() - t0)
        raise
    return _judge(kind, r, time.monotonic() - t0)


async def do_fork(client: httpx.AsyncClient, s: Soak, rng: random.Random) -> Record:
    """Two continuations of one conversation, concurrently (they share a cached prefix)."""
    t0 = time.monotonic()

    async def branch(i: int) -> httpx.Response:
        messages = [*FORK_PREFIX, {"role": "user", "content": f"Variant {i}: {rng.choice(TOPICS)}"
                                                              "? Answer in one line."}]
        return await client.post("/v1/chat/completions", json={
            "model": s.model, "messages": messages, "max_tokens": rng.randint(8, 32),
            "temperature": 0})

    responses = await asyncio.gather(branch(0), branch(1))
    bad = next((r for r in responses if r.status_code != 200), None)
    return _judge("fork", bad or responses[0], time.monotonic() - t0)


async def do_completion(client: httpx.AsyncClient, s: Soak, rng: random.Random) -> Record:
    t0 = time.monotonic()
    r = await client.post("/v1/completions", json={
        "model": s.model, "prompt": f"Once upon a time, {rng.choice(TOPICS)}",
        "max_tokens": rng.randint(8, 48), "temperature": 0.8, "seed": rng.randint(0, 99)})
    return _judge("completion", r, time.monotonic() - t0)


def _bad_requests(model: str) -> list[tuple[str, bytes]]:
    def j(body: Any) -> bytes:
        return json.dumps(body).encode()

    user = [{"role": "user", "content": "hi"}]
    return [
        ("/v1/chat/completions", b'{"model": "x", "messages": ['),
        ("/v1/chat/completions", j({"model": "no-such-model", "messages": user})),
        ("/v1/chat/completions", j({"model": model, "messages": "hi"})),
        ("/v1/chat/completions", j({"model": model, "messages": user, "max_tokens": -1})),
        ("/v1/chat/completions", j({"model": model, "messages": user, "temperature": "hot"})),
        ("/v1/chat/completions", j({"model": model, "messages": [
            {"role": "user", "content": "word " * 40000}]})),
        ("/v1/chat/completions", j({"model": model, "max_tokens": 16, "messages": [
            {"role": "tool", "content": "42", "tool_call_id": "call_missing"}]})),
        ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", '
                                 b'"content": "\xff\xfe"}]}'),
        ("/v1/chat/completions", j({"model": model, "messages": [
            {"role": "wizard", "content": "x"}]})),
        ("/v1/chat/completions", j({"model": model, "messages": [], "max_tokens": 16})),
        ("/v1/completions", j({"model": model, "prompt": [10**12]})),
        ("/v1/completions", j({"model": model, "prompt": "x", "n": 10**6})),
    ]


async def do_bad(client: httpx.AsyncClient, s: Soak, rng: random.Random) -> Record:
    path, content = rng.choice(_bad_requests(s.model))
    t0 = time.monotonic()
    r = await client.post(path, content=content, headers={"content-type": "application/json"})
    latency = time.monotonic() - t0
    if 400 <= r.status_code < 500:
        try:
            err = r.json()["error"]
            shaped = {"message", "type", "param", "code"} <= set(err)
        except (ValueError, KeyError, TypeError):
            shaped = False
        return Record("bad", "refused" if shaped else "refused_without_openai_body", latency)
    # a tool message without its call may be accepted by a permissive template: not a failure
    if r.status_code == 200:
        return Record("bad", "accepted", latency)
    return Record("bad", f"http_{r.status_code}", latency, detail=r.text[:200])


def _judge(kind: str, r: httpx.Response, latency: float) -> Record:
    if r.status_code == 200:
        return Record(kind, "ok", latency)
    return Record(kind, f"http_{r.status_code}", latency, detail=r.text[:200])


async def worker(client: httpx.AsyncClient, s: Soak, seed: int) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items())
    while s.take():
        kind = rng.choices(kinds, weights)[0]
        t0 = time.monotonic()
        try:
            if kind == "stream":
                rec = await do_stream(client, s, rng, None)
            elif kind == "stream_abort":
                rec = await do_stream(client, s, rng, rng.randint(1, 6))
            elif kind == "chat":
                rec = await do_chat(client, s, rng, None)
            elif kind == "chat_abort":
                rec = await do_chat(client, s, rng, rng.uniform(0.2, 1.5))
            elif kind == "fork":
                rec = await do_fork(client, s, rng)
            elif kind == "completion":
                rec = await do_completion(client, s, rng)
            else:
                rec = await do_bad(client, s, rng)
        except httpx.HTTPError as e:
            rec = Record(kind, f"client_{type(e).__name__}", time.monotonic() - t0, detail=str(e))
        s.records.append(rec)


# --------------------------------------------------------------------------- server side


def find_pid(port: int) -> int | None:
    """PID of the process listening on `port` (psutil), or None."""
    import psutil

    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port:
            return conn.pid
    return None


class RssSampler:
    """Samples a process's resident set size (bytes) and the bytes its host tier holds
    (`host_tier_bytes` of /debug/state, 0 without one) every `period_s`, in a thread."""

    def __init__(self, pid: int | None, url: str, period_s: float = 1.0) -> None:
        self.samples: list[tuple[float, int, int]] = []  # (s since start, rss, host tier)
        self._stop = threading.Event()
        self._url = url
        self._proc = None
        if pid is not None:
            import psutil

            self._proc = psutil.Process(pid)
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)

    def _run(self, period_s: float) -> None:
        t0 = time.monotonic()
        while self._proc is not None and not self._stop.is_set():
            try:
                tier = int(state(self._url).get("host_tier_bytes", 0))
            except httpx.HTTPError:
                tier = self.samples[-1][2] if self.samples else 0
            self.samples.append((time.monotonic() - t0, self._proc.memory_info().rss, tier))
            self._stop.wait(period_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(5)


def state(url: str) -> dict:
    return httpx.get(url + "/debug/state", timeout=10).json()


def wait_idle(url: str, timeout_s: float) -> dict:
    """/debug/state once nothing runs or waits and requests hold no pages (or at timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = state(url)
        held = st["pages_used"] - st.get("prefix_cache_pages", 0)
        if (st["num_running"] == 0 and st["num_waiting"] == 0 and held == 0) \
                or time.monotonic() > deadline:
            return st
        time.sleep(0.2)


async def run(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
    port = httpx.URL(url).port or 80
    pid = args.pid or find_pid(port)
    before = wait_idle(url, 30)
    soak = Soak(url, model, time.monotonic() + args.minutes * 60, args.max_requests)
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=args.concurrency * 2 + 4)
    with RssSampler(pid, url, args.rss_period) as rss:
        async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                     timeout=REQUEST_TIMEOUT_S) as client:
            await asyncio.gather(*(worker(client, soak, args.seed * 1000 + i)
                                   for i in range(args.concurrency)))
        elapsed = time.monotonic() - t0
        after = wait_idle(url, 30)
        time.sleep(args.rss_period)  # one more sample, after the traffic
    text, figures, failures = report(soak.records, soak.url, soak.model, rss.samples, before,
                                     after, elapsed, args.rss_bound_mb,
                                     min(args.warmup, elapsed / 2))
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures | {"failures": failures}, f, indent=1)
    for r in soak.records:
        if r.detail and r.outcome.startswith(FAILURE_PREFIXES):
            print(f"  e.g. {r.kind} {r.outcome}: {r.detail}", file=sys.stderr)
            break
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL")
    p.add_argument("--minutes", type=float, default=2.0, help="how long to send traffic")
    p.add_argument("--max-requests", type=int, default=10**9, help="stop after this many")
    p.add_argument("--concurrency", type=int, default=6, help="concurrent client workers")
    p.add_argument("--seed", type=int, default=0, help="seed of the traffic mix")
    p.add_argument("--pid", type=int, default=None, help="server PID (default: by port)")
    p.add_argument("--api-key", default=None, help="bearer key, if the server needs one")
    p.add_argument("--rss-period", type=float, default=1.0, help="RSS sampling period, s")
    p.add_argument("--rss-bound-mb", type=float, default=256.0,
                   help="fail when RSS grows more than this after the warm-up, MiB, not "
                        "counting the host tier's growth (default 256)")
    p.add_argument("--warmup", type=float, default=20.0,
                   help="seconds of traffic before the RSS reference sample (default 20)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
