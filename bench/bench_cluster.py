"""Scale-out figures: a multi-client agent workload against (1) one replica, (2) two
replicas behind smg round_robin without a shared tier, (3) two replicas with the Redis
remote tier behind smg cache_aware. Prints, per setup: median and p90 TTFT (client clock,
first streamed content), cached tokens per turn (the mean of
usage.prompt_tokens_details.cached_tokens over the turns after the first), cached tokens
as a fraction of those turns' prompt tokens, and aggregate completion tokens/s.

The workload is one where routing matters: each client is an agent with a long history of
its own (a distinct "repository listing" first, then a tool output every turn), and every
replica's caches are kept small (the package is prepared with `--num-pages` and
`--host-tier-mib`) so that one replica holds the recent states of only some clients. A replica that sees every client (one replica, or
round-robin) then evicts and recomputes; cache-aware routing keeps each client on one
replica, and what does get evicted or moved is restored from Redis.

    .venv/bin/python bench/bench_cluster.py [--package PKG] [--clients 6] [--turns 5]
        [--context-lines 12] [--tool-lines 2] [--num-pages 96] [--host-tier-mib 4]

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
    """smg in its HTTP worker mode (docs/scale-out.md) over `urls`, once it lists them all
    as healthy with their model."""
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("smg")), "launch", "--host", "127.0.0.1",
         "--port", str(port), "--prometheus-host", "127.0.0.1",
         "--prometheus-port", str(free_port()), "--policy", policy,
         "--worker-urls", *urls, "--log-level", "warn"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
            if sum(w["is_healthy"] and bool(w["models"]) for w in workers) == len(urls):
                return proc, url
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(log.read_text()[-2000:])
        time.sleep(0.3)


def turn(http: httpx.Client, url: str, model: str, messages: list[dict],
         max_tokens: int) -> tuple[float, int, int, int, str]:
    """(TTFT s, prompt tokens, cached tokens, completion tokens, text) of one streamed chat
    turn."""
    t0, ttft, out, usage = time.perf_counter(), None, [], {}
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read().decode()[:300]}")
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
    return (ttft or time.perf_counter() - t0, usage.get("prompt_tokens", 0), cached,
            usage.get("completion_tokens", 0), "".join(out))


def listing(k: int, lines: int, salt: str) -> str:
    """`lines` lines of text no other client shares (about 33 tokens a line)."""
    return "\n".join(f"src/pkg{k}/mod_{salt}{i}.py: def step_{k}_{salt}{i}(x): "
                     f"return x * {k * 31 + i} + {i * 7}" for i in range(lines))


def workload(url: str, model: str, args: argparse.Namespace) -> dict:
    ttfts, cached, prompt, tokens, lock = [], [], [], [0], threading.Lock()

    def client(k: int) -> None:
        msgs = [{"role": "system", "content": "You are a coding agent. Be brief."},
                {"role": "user", "content": f"Task {k}: plan a refactor of this repository."
                                            f"\n{listing(k, args.context_lines, 'r')}"}]
        with httpx.Client(timeout=600) as http:
            for t in range(args.turns):
                ttft, p, c, n, text = turn(http, url, model, msgs, args.max_tokens)
                with lock:
                    ttfts.append(ttft)
                    if t:
                        cached.append(c)
                        prompt.append(p)
                    tokens[0] += n
                msgs += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"Tool output {t}:\n"
                                                     f"{listing(k, args.tool_lines, f't{t}_')}"
                                                     f"\nNext step."}]

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    q = statistics.quantiles(ttfts, n=10)
    return {"ttft_median_s": statistics.median(ttfts), "ttft_p90_s": q[-1],
            "cached_per_turn": statistics.mean(cached) if cached else 0.0,
            "cached_fraction": sum(cached) / sum(prompt) if sum(prompt) else 0.0,
            "tokens_per_s": tokens[0] / wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--package", type=Path, default=None,
                   help="package folder, used with its own plan (default: the embedded "
                        "model, prepared in WORK_DIR/package with the small caches below)")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--context-lines", type=int, default=12,
                   help="lines of each client's own first message (about 33 tokens each)")
    p.add_argument("--tool-lines", type=int, default=2, help="lines of each tool output")
    p.add_argument("--num-pages", type=int, default=96,
                   help="each replica's KV pages (16 tokens each): room for a few clients")
    p.add_argument("--host-tier-mib", type=int, default=4,
                   help="each replica's host tier (the embedded model: 46 KB a token)")
    p.add_argument("--max-seq-len", type=int, default=1536,
                   help="the small package's longest sequence (at most the pool)")
    p.add_argument("--work-dir", type=Path, default=ROOT / ".cluster" / "bench")
    args = p.parse_args()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    package = args.package
    if package is None:  # the cache sizes are the package's plan: a small-cache package
        from flare.loading.embedded import embedded_model_path
        from flare.prepare.package import ensure_package

        package = ensure_package(embedded_model_path(), work / "package",
                                 max_seq_len=args.max_seq_len, num_pages=args.num_pages,
                                 host_tier_bytes=args.host_tier_mib << 20)
    rows = {}

    one = ServerProcess(package, work / "one.log")
    try:
        model = httpx.get(one.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        rows["1 replica"] = workload(one.url, model, args)
    finally:
        one.stop()

    def behind_gateway(policy: str, tag: str, extra: tuple[str, ...] = ()) -> dict:
        """The workload through `smg --policy policy` over two replicas (`extra` flags)."""
        a = ServerProcess(package, work / f"{tag}a.log", extra)
        b = ServerProcess(package, work / f"{tag}b.log", extra)
        try:
            gw, url = gateway([a.url, b.url], policy, work / f"gw-{tag}.log")
            try:
                return workload(url, model, args)
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
          f"greedy; " + (f"each replica {args.num_pages} KV pages of 16 tokens, "
                         f"{args.host_tier_mib} MiB host tier" if args.package is None
                         else f"package {package}"))
    print(f"{'setup':40} {'TTFT p50 s':>10} {'TTFT p90 s':>10} {'cached/turn':>11} "
          f"{'cached %':>8} {'tok/s':>7}")
    for name, r in rows.items():
        print(f"{name:40} {r['ttft_median_s']:10.3f} {r['ttft_p90_s']:10.3f} "
              f"{r['cached_per_turn']:11.1f} {100 * r['cached_fraction']:8.1f} "
              f"{r['tokens_per_s']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
