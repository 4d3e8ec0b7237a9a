"""Scale-out figures: a multi-client agent workload (each client a growing conversation)
against (1) one replica, (2) two replicas behind smg round_robin without a shared tier,
(3) two replicas with the Redis remote tier behind smg cache_aware. Prints, per setup:
median and p90 TTFT (client clock, first streamed content), cached tokens per turn (the
mean of usage.prompt_tokens_details.cached_tokens), and aggregate completion tokens/s.

    .venv/bin/python bench/bench_cluster.py [--package PKG] [--clients 4] [--turns 8]

Figures only (no pass/fail); on a shared or busy machine they mean little: say so when
quoting them. Everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "integration"))
from redis_process import RedisProcess, free_port  # noqa: E402
from server_process import ServerProcess  # noqa: E402


def gateway(urls: list[str], policy: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("smg")), "launch", "--host", "127.0.0.1",
         "--port", str(port), "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(free_port()), "--backend", "openai", "--policy", policy,
         "--worker-urls", *urls, "--log-level", "warn"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(log.read_text()[-2000:])
        time.sleep(0.3)


def turn(http: httpx.Client, url: str, model: str, messages: list[dict],
         max_tokens: int) -> tuple[float, int, int, str]:
    """(TTFT s, cached tokens, completion tokens, text) of one streamed chat turn."""
    t0, ttft, out, usage = time.perf_counter(), None, [], {}
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft or time.perf_counter() - t0
                    out.append(piece)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ttft or time.perf_counter() - t0, cached, usage.get("completion_tokens", 0), \
        "".join(out)


def workload(url: str, model: str, clients: int, turns: int, max_tokens: int) -> dict:
    ttfts, cached, tokens, lock = [], [], [0], threading.Lock()

    def client(k: int) -> None:
        msgs = [{"role": "system", "content": "You are a coding agent. Be brief."},
                {"role": "user", "content": f"Task {k}: plan a small refactor of a "
                                            f"parser module, step by step."}]
        with httpx.Client(timeout=300) as http:
            for t in range(turns):
                ttft, c, n, text = turn(http, url, model, msgs, max_tokens)
                with lock:
                    ttfts.append(ttft)
                    if t:
                        cached.append(c)
                    tokens[0] += n
                msgs += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"Tool output {t}: ok. Next step."}]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    q = statistics.quantiles(ttfts, n=10)
    return {"ttft_median_s": statistics.median(ttfts), "ttft_p90_s": q[-1],
            "cached_per_turn": statistics.mean(cached) if cached else 0.0,
            "tokens_per_s": tokens[0] / wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--package", type=Path, default=None,
                   help="package folder (default: the embedded model's, prepared in "
                        ".cache/flare)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--work-dir", type=Path, default=ROOT / ".cluster" / "bench")
    args = p.parse_args()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    package = args.package
    if package is None:
        from flare.loading.embedded import embedded_model_path
        from flare.prepare.package import ensure_package

        package = ensure_package(embedded_model_path(), ROOT / ".cache" / "flare")
    rows = {}

    one = ServerProcess(package, work / "one.log")
    try:
        model = httpx.get(one.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        rows["1 replica"] = workload(one.url, model, args.clients, args.turns,
                                     args.max_tokens)
    finally:
        one.stop()

    def behind_gateway(policy: str, tag: str, extra: tuple[str, ...] = ()) -> dict:
        """The workload through `smg --policy policy` over two replicas (`extra` flags)."""
        a = ServerProcess(package, work / f"{tag}a.log", extra)
        b = ServerProcess(package, work / f"{tag}b.log", extra)
        try:
            gw, url = gateway([a.url, b.url], policy, work / f"gw-{tag}.log")
            try:
                return workload(url, model, args.clients, args.turns, args.max_tokens)
            finally:
                gw.terminate()
                gw.wait(20)
        finally:
            a.stop()
            b.stop()

    rows["2 replicas, round_robin, no shared tier"] = behind_gateway("round_robin", "rr")
    redis = RedisProcess(work / "redis")
    try:
        rows["2 replicas, smg cache_aware + Redis"] = behind_gateway(
            "cache_aware", "ca", ("--remote-tier", redis.url))
    finally:
        redis.stop()

    print(f"{args.clients} clients x {args.turns} turns, {args.max_tokens} tokens a turn, "
          f"greedy")
    print(f"{'setup':44} {'TTFT p50 s':>10} {'TTFT p90 s':>10} {'cached/turn':>11} "
          f"{'tok/s':>7}")
    for name, r in rows.items():
        print(f"{name:44} {r['ttft_median_s']:10.3f} {r['ttft_p90_s']:10.3f} "
              f"{r['cached_per_turn']:11.1f} {r['tokens_per_s']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
