"""Multi-turn agent session: TTFT per turn with prefix reuse on and off, in one run.

Replays a coding-agent session from the shipped corpus (tool calls and tool results as chat
messages) turn by turn against two real servers started from the same package: one with
the prefix cache, one with `--no-prefix-cache`. Each turn is sent to both (order
alternating), streamed; TTFT is the client-clock time from sending to the first SSE event
that carries content. Figures, not pass/fail.

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


def _streamed_ttft(url: str, path: str, body: dict, has_text) -> tuple[float, dict]:
    """(client-clock ms from sending `body` to `path` until the first SSE event that
    `has_text`, the usage chunk if the server sent one), reading the stream to its end."""
    body = {**body, "model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"],
            "temperature": 0, "stream": True}
    first, usage = None, {}
    t0 = time.monotonic_ns()
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=600) as r:
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


def peer_ttft(url: str, prompt: str, max_tokens: int) -> float:
    """TTFT ms of a streamed text completion of `prompt` against an OpenAI-compatible
    server (the peer)."""
    return _streamed_ttft(url, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens},
                          lambda c: c.get("text"))[0]


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
    package = args.package
    if package is None:
        from flare.loading.embedded import embedded_model_path
        from flare.prepare.package import prepare_package

        package = tmp / "pkg"
        prepare_package(embedded_model_path(), package, max_seq_len=8192, max_num_seqs=2,
                        progress=False)
    name, requests = conversation(args.turns)
    render = None
    if args.peer_url:
        from transformers import AutoTokenizer

        from flare.server.chat import render_chat

        tokenizer = AutoTokenizer.from_pretrained(str(package), local_files_only=True)
        render = lambda messages: render_chat(tokenizer, messages)  # noqa: E731
    on = ManagedServer(package, tmp / "on.log")
    off = ManagedServer(package, tmp / "off.log", extra_args=("--no-prefix-cache",))
    rows = []
    with on, off:
        for i, messages in enumerate(requests):
            pair = [(on, "on"), (off, "off")][:: 1 if i % 2 == 0 else -1]
            res = {tag: ttft(srv.url, messages, args.max_tokens) for srv, tag in pair}
            peer = (peer_ttft(args.peer_url, render(messages), args.max_tokens)
                    if render else float("nan"))
            rows.append((i + 1, res["on"][1]["prompt_tokens"],
                         res["on"][1]["prompt_tokens_details"]["cached_tokens"],
                         res["on"][0], res["off"][0], peer))
    print(f"corpus {name}; package {package}; {len(rows)} turns, max_tokens {args.max_tokens}")
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'TTFT on ms':>11} {'TTFT off ms':>12} "
          f"{'off/on':>7} {'peer ms':>8}")
    for turn, prompt, cached, t_on, t_off, t_peer in rows:
        print(f"{turn:>4} {prompt:>7} {cached:>7} {t_on:>11.0f} {t_off:>12.0f} "
              f"{t_off / t_on:>7.2f} {t_peer:>8.0f}")
    later = rows[1:]
    med_on = statistics.median(r[3] for r in later)
    med_off = statistics.median(r[4] for r in later)
    print(f"median TTFT turns 2-{len(rows)}: reuse on {med_on:.0f} ms, off {med_off:.0f} ms, "
          f"off/on {med_off / med_on:.2f}")
    if render:
        med_peer = statistics.median(r[5] for r in later)
        print(f"peer {args.peer_url}: median TTFT turns 2-{len(rows)} {med_peer:.0f} ms, "
              f"peer/on {med_peer / med_on:.2f}")


if __name__ == "__main__":
    main()
