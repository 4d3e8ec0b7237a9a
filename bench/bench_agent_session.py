"""Multi-turn agent session: TTFT per turn with prefix reuse on and off, in one run.

Replays a coding-agent session from the shipped corpus (tool calls and tool results as chat
messages) turn by turn against two real servers started from the same package: one with
the prefix cache, one with `--no-prefix-cache`. Each turn is sent to both (order
alternating), streamed; TTFT is the client-clock time from sending to the first SSE event
that carries content. Figures, not pass/fail.

    .venv/bin/python bench/bench_agent_session.py [--package PKG] [--turns 20]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

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


def ttft(url: str, messages: list[dict], max_tokens: int) -> tuple[float, dict]:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    first, usage = None, {}
    t0 = time.monotonic_ns()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.monotonic_ns()
            if chunk.get("usage"):
                usage = chunk["usage"]
    return ((first or time.monotonic_ns()) - t0) / 1e6, usage


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--package", type=Path, default=None,
                    help="runtime package (default: prepare the embedded model in a temp dir)")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="flare-bench-"))
    package = args.package
    if package is None:
        from flare.loading.embedded import embedded_model_path
        from flare.prepare.package import prepare_package

        package = tmp / "pkg"
        prepare_package(embedded_model_path(), package, max_seq_len=8192, max_num_seqs=2,
                        progress=False)
    name, requests = conversation(args.turns)
    on = ManagedServer(package, tmp / "on.log")
    off = ManagedServer(package, tmp / "off.log", extra_args=("--no-prefix-cache",))
    rows = []
    with on, off:
        for i, messages in enumerate(requests):
            pair = [(on, "on"), (off, "off")][:: 1 if i % 2 == 0 else -1]
            res = {tag: ttft(srv.url, messages, args.max_tokens) for srv, tag in pair}
            rows.append((i + 1, res["on"][1]["prompt_tokens"],
                         res["on"][1]["prompt_tokens_details"]["cached_tokens"],
                         res["on"][0], res["off"][0]))
    print(f"corpus {name}; package {package}; {len(rows)} turns, max_tokens {args.max_tokens}")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT on ms':>11} {'TTFT off ms':>12} "
          f"{'off/on':>7}")
    for turn, prompt, cached, t_on, t_off in rows:
        print(f"{turn:>4} {prompt:>7} {cached:>7} {t_on:>11.0f} {t_off:>12.0f} "
              f"{t_off / t_on:>7.2f}")
    later = rows[1:]
    med_on = statistics.median(r[3] for r in later)
    med_off = statistics.median(r[4] for r in later)
    print(f"median TTFT turns 2-{len(rows)}: reuse on {med_on:.0f} ms, off {med_off:.0f} ms, "
          f"off/on {med_off / med_on:.2f}")


if __name__ == "__main__":
    main()
