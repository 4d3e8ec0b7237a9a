"""Multi-turn agent session: TTFT per turn with prefix reuse on and off, in one run.

Replays a coding-agent session from the shipped corpus (tool calls and tool results as chat
messages) turn by turn against two real servers started from the same package: one with
the prefix cache, one with `--no-prefix-cache`. Each turn is sent to each server in turn
(the order rotating from turn to turn), streamed; TTFT is the client-clock time from
sending to the first SSE event that carries content, over one kept-alive HTTP client
(as an agent's SDK holds). Figures, not pass/fail.

    .venv/bin/python bench/bench_agent_session.py [--package PKG] [--turns 20]
        [--peer-url http://127.0.0.1:8090]

`--peer-url` adds a column for another OpenAI-compatible server holding the same model,
e.g. llama.cpp's (`pip install 'llama-cpp-python[server]'`, a source build of ~11 min):

    .venv/bin/python -m llama_cpp.server --model <the embedded GGUF> --n_threads 2 \
        --n_ctx 8192 --cache true --port 8090

The peer gets each turn as `/v1/completions` with the prompt text Flare's chat template
renders for it (so both servers see the same text whatever chat handler the peer has),
streamed, with its own prompt cache deciding what it reuses. Run the peer alone on the
machine's cores: the Flare servers are idle while it answers, as it is while they do.
`against_llama_cpp` (what bench/peers.py runs) starts that peer itself
(`llama_cpp_server.LlamaCppServer`) beside one Flare server with the prefix cache.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flare.qualify.server import ManagedServer

CORPUS = Path(__file__).resolve().parent.parent / "corpus" / "agent-sessions-v1.json"


def conversation(turns: int) -> tuple[str, list[list[dict]]]:
    """The requests of one long session: each is the history up to a user/tool message.

    Sessions of the corpus are chained (as one agent working through several tasks) until
    `turns` requests exist, so the context grows to a few thousand tokens.
    """
    corpus = json.loads(CORPUS.read_text())
    history = [{"role": "system", "content": corpus["system"]}]
    requests: list[list[dict]] = []
    for session in sorted(corpus["sessions"], key=lambda s: -len(s["messages"])):
        for msg in session["messages"]:
            history.append(msg)
            if msg["role"] == "user":
                requests.append(list(history))
                if len(requests) == turns:
                    return corpus["name"], requests
    return corpus["name"], requests


@functools.cache
def _client() -> httpx.Client:
    """The one HTTP client every turn goes through, as an agent's SDK client: kept-alive
    connections, and its TLS context built once. (A client made per turn spends ~28 ms
    building that context, inside the TTFT of whichever server it measured.)"""
    return httpx.Client(timeout=600)


@functools.cache
def _model_id(url: str) -> str:
    """The id of the model the server at `url` serves (asked once a server)."""
    return _client().get(f"{url}/v1/models").json()["data"][0]["id"]


def _streamed_ttft(url: str, path: str, body: dict, has_text) -> tuple[float, dict]:
    """(client-clock ms from sending `body` to `path` until the first SSE event that
    `has_text`, the usage chunk if the server sent one), reading the stream to its end."""
    client = _client()
    body = {**body, "model": _model_id(url), "temperature": 0, "stream": True}
    first, usage = None, {}
    t0 = time.monotonic_ns()
    with client.stream("POST", f"{url}{path}", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(has_text(c) for c in chunk["choices"]):
                first = time.monotonic_ns()
            if chunk.get("usage"):
                usage = chunk["usage"]
    return ((first or time.monotonic_ns()) - t0) / 1e6, usage


def ttft(url: str, messages: list[dict], max_tokens: int) -> tuple[float, dict]:
    """A streamed chat turn against Flare: (TTFT ms, usage)."""
    return _streamed_ttft(url, "/v1/chat/completions", {
        "messages": messages, "max_tokens": max_tokens,
        "stream_options": {"include_usage": True}}, lambda c: c["delta"].get("content"))


def peer_ttft(url: str, prompt: str, max_tokens: int) -> tuple[float, dict]:
    """A streamed text completion of `prompt` against an OpenAI-compatible server (the
    peer): (TTFT ms, usage if sent)."""
    return _streamed_ttft(url, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens},
                          lambda c: c.get("text"))


def default_package(folder: Path) -> Path:
    """The embedded model prepared with Flare's defaults (its weight format) at
    `folder`/pkg, planned for this session: 8,192 positions, 2 sequences."""
    from flare.loading.embedded import embedded_model_path
    from flare.prepare.package import prepare_package

    package = folder / "pkg"
    prepare_package(embedded_model_path(), package, max_seq_len=8192, max_num_seqs=2,
                    progress=False)
    return package


def chat_renderer(package: Path) -> Callable[[list[dict]], str]:
    """messages -> the prompt text Flare's chat template renders for them (the peer's
    /v1/completions prompt, so both servers see the same text)."""
    from transformers import AutoTokenizer

    from flare.server.chat import render_chat

    tokenizer = AutoTokenizer.from_pretrained(str(package), local_files_only=True)
    return lambda messages: render_chat(tokenizer, messages)


Target = Callable[[list[dict]], tuple[float, dict]]  # messages -> (TTFT ms, usage)


def session_ttfts(requests: list[list[dict]], targets: dict[str, Target],
                  deadline: float | None = None) -> list[dict[str, tuple[float, dict]]]:
    """Each turn's (TTFT ms, usage) from every target: name -> result, one dict a turn.
    The targets answer one at a time, in an order that rotates each turn (none is always
    first); no turn starts after `deadline` (a `time.monotonic()` reading)."""
    names = list(targets)
    rows = []
    for i, messages in enumerate(requests):
        if deadline is not None and time.monotonic() > deadline:
            break
        order = names[i % len(names):] + names[:i % len(names)]
        rows.append({name: targets[name](messages) for name in order})
    return rows


def later_median(rows: list[dict[str, tuple[float, dict]]], name: str) -> float | None:
    """Median TTFT ms of target `name` over turns 2 onwards (the first fills the caches);
    None with fewer than 2 turns."""
    later = [r[name][0] for r in rows[1:]]
    return statistics.median(later) if later else None


def against_llama_cpp(gguf: Path, threads: int, turns: int, max_tokens: int,
                      budget_s: float, folder: Path) -> dict:
    """The session against Flare's server on the default package (prefix cache on,
    `--threads threads`) and llama.cpp's (`LlamaCppServer` on `gguf`, its prompt cache
    on), both started here and stopped after at most `budget_s` seconds of turns.

    Returns {"corpus", "turns" (done), "flare" and "llama.cpp" (median TTFT ms over
    turns 2 on, None when fewer than 2 ran), "peer_problem" (why llama.cpp has no
    figure, or None), "flare_peak_rss" (the Flare server's VmHWM after the turns, bytes;
    None where /proc cannot tell), "report_total" (its package's memory report total,
    bytes)}. Raises ServerStartError when Flare's server does not start.
    """
    from bench_memory import memory_report, proc_memory
    from llama_cpp_server import LlamaCppServer, server_problem

    package = default_package(folder)
    name, requests = conversation(turns)
    flare = ManagedServer(package, folder / "flare.log", extra_args=("--threads", str(threads)))
    targets: dict[str, Target] = {"flare": lambda m: ttft(flare.url, m, max_tokens)}
    problem = server_problem()
    with contextlib.ExitStack() as stack:
        stack.enter_context(flare)
        if problem is None:
            try:
                peer = stack.enter_context(LlamaCppServer(gguf, threads, folder / "llama.log"))
            except RuntimeError as exc:  # the message's first line and its log's last
                lines = [line for line in str(exc).splitlines() if line.strip()]
                problem = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
            else:
                render = chat_renderer(package)
                targets["llama.cpp"] = lambda m: peer_ttft(peer.url, render(m), max_tokens)
        rows = session_ttfts(requests, targets, time.monotonic() + budget_s)
        try:  # read while the server still runs: its peak over start-up and every turn
            peak = proc_memory(flare.proc.pid)["VmHWM"]
        except (OSError, KeyError):
            peak = None
    return {"corpus": name, "turns": len(rows), "flare": later_median(rows, "flare"),
            "llama.cpp": later_median(rows, "llama.cpp") if problem is None else None,
            "peer_problem": problem, "flare_peak_rss": peak,
            "report_total": memory_report(package)["total_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", type=Path, default=None,
                    help="runtime package (default: prepare the embedded model in a temp dir)")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--peer-url", default=None,
                    help="another OpenAI-compatible server with the same model (a column)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="flare-bench-"))
    package = args.package or default_package(tmp)
    name, requests = conversation(args.turns)
    on = ManagedServer(package, tmp / "on.log")
    off = ManagedServer(package, tmp / "off.log", extra_args=("--no-prefix-cache",))
    targets: dict[str, Target] = {"on": lambda m: ttft(on.url, m, args.max_tokens),
                                  "off": lambda m: ttft(off.url, m, args.max_tokens)}
    if args.peer_url:
        render = chat_renderer(package)
        targets["peer"] = lambda m: peer_ttft(args.peer_url, render(m), args.max_tokens)
    with on, off:
        turns = session_ttfts(requests, targets)
    print(f"corpus {name}; package {package}; {len(turns)} turns, max_tokens {args.max_tokens}")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT on ms':>11} {'TTFT off ms':>12} "
          f"{'off/on':>7} {'peer ms':>8}")
    for i, t in enumerate(turns):
        usage = t["on"][1]
        t_on, t_off = t["on"][0], t["off"][0]
        t_peer = t["peer"][0] if "peer" in t else float("nan")
        print(f"{i + 1:>4} {usage['prompt_tokens']:>7} "
              f"{usage['prompt_tokens_details']['cached_tokens']:>7} {t_on:>11.0f} "
              f"{t_off:>12.0f} {t_off / t_on:>7.2f} {t_peer:>8.0f}")
    med_on, med_off = later_median(turns, "on"), later_median(turns, "off")
    print(f"median TTFT turns 2-{len(turns)}: reuse on {med_on:.0f} ms, off {med_off:.0f} ms, "
          f"off/on {med_off / med_on:.2f}")
    if args.peer_url:
        med_peer = later_median(turns, "peer")
        print(f"peer {args.peer_url}: median TTFT turns 2-{len(turns)} {med_peer:.0f} ms, "
              f"peer/on {med_peer / med_on:.2f}")


if __name__ == "__main__":
    main()
