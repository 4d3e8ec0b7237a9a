"""Exact by default, over HTTP: `flare serve` on the embedded model's package in its default
format (`q4x8`, the GGUF's own blocks) answers 20 greedy prompts with the same text and
the same logprobs, to the last bit of their JSON floats, cold (first sight on a fresh
server), warm (sent again: the prefix cache reuses them) and batched (all 20 at once:
continuous batching, chunked prefill beside decode steps).

The prompts follow the cases of shared/cases/: state-exact-boundary (prompts whose common
prefix ends at a page boundary, one token before and one after it),
state-template-drift (a second turn resends the first answer with its whitespace
trimmed), state-short-first-turn (a short first turn, then its continuation), the issue's
own "A race condition happens when" (case state-fast-path-cold-warm: it changed cold
against warm before), and
completions / chats of several lengths.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_process import ServerProcess

MAX_TOKENS = 16

BASE = ("In a small village by the sea there lived an old fisherman who every morning "
        "walked down to the harbour and")
COMPLETIONS = [
    "A race condition happens when",
    "The capital of France is",
    "def fibonacci(n):",
    "Paged attention stores the KV cache in",
    "Continuous batching lets a server",
    "The three laws of thermodynamics are",
    "import numpy as np\n\ndef softmax(x):",
    "Once upon a time",
    "SELECT name FROM users WHERE",
    "A prefix cache helps because",
]


def _boundary_prompts(tokenizer) -> list[str]:
    """state-exact-boundary: prompts sharing BASE's tokens up to a page boundary (16),
    one token before it and one after it, each then going its own way."""
    ids = tokenizer.encode(BASE, add_special_tokens=False)
    assert len(ids) > 18
    return [tokenizer.decode(ids[:cut]) + tail for cut, tail in
            ((16, " a dog"), (15, " the sun"), (17, " seven boats"), (len(ids), " sang"))]


CHATS = [
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is a KV cache?"}],
    [{"role": "user", "content": "Hi"}],  # state-short-first-turn, turn 1
    [{"role": "user", "content": "List three prime numbers."}],
]


def _second_turns(first_answers: list[str]) -> list[list[dict]]:
    """state-short-first-turn and state-template-drift: turn 2 of CHATS[2] and CHATS[3],
    the first answer resent with its surrounding whitespace trimmed."""
    return [CHATS[2] + [{"role": "assistant", "content": first_answers[0].strip()},
                        {"role": "user", "content": "And how are you?"}],
            CHATS[3] + [{"role": "assistant", "content": first_answers[1].strip() + "  "},
                        {"role": "user", "content": "Now three even ones."}]]


@pytest.fixture(scope="module")
def server(smollm2_package: Path, tmp_path_factory):
    manifest = json.loads((smollm2_package / "manifest.json").read_text())
    assert manifest["tuning"]["weights"] == "q4x8", "the embedded model's default format"
    srv = ServerProcess(smollm2_package, tmp_path_factory.mktemp("exact") / "serve.log")
    yield srv
    srv.stop()


def _ask(client: httpx.Client, req: tuple[str, object]) -> tuple[str, list, int]:
    """One greedy request: (text, logprobs as JSON values, cached prompt tokens)."""
    kind, body = req
    model = client.get("/v1/models").json()["data"][0]["id"]
    if kind == "completion":
        r = client.post("/v1/completions", json={
            "model": model, "prompt": body, "temperature": 0, "max_tokens": MAX_TOKENS, "logprobs": 2})
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        lp = choice["logprobs"]
        logprobs = [lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]]
    else:
        r = client.post("/v1/chat/completions", json={
            "model": model, "messages": body, "temperature": 0, "max_tokens": MAX_TOKENS,
            "logprobs": True, "top_logprobs": 2})
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        logprobs = choice["logprobs"]["content"]
        choice = {"text": choice["message"]["content"]}
    cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return choice["text"], logprobs, cached


def test_greedy_answers_and_logprobs_equal_cold_warm_and_batched(server, smollm2_tokenizer):
    with httpx.Client(base_url=server.url, timeout=300) as client:
        requests = [("completion", p) for p in COMPLETIONS]
        requests += [("completion", p) for p in _boundary_prompts(smollm2_tokenizer)]
        requests += [("chat", m) for m in CHATS]
        cold = [_ask(client, r) for r in requests]
        requests += [("chat", m) for m in _second_turns([cold[-2][0], cold[-1][0]])]
        cold += [_ask(client, r) for r in requests[len(cold):]]
        assert len(requests) == 20

        warm = [_ask(client, r) for r in requests]
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            batched = list(pool.map(lambda r: _ask(client, r), requests))

    assert sum(1 for _, _, cached in warm if cached > 0) >= 15, [c for *_, c in warm]
    for i, req in enumerate(requests):
        assert warm[i][:2] == cold[i][:2], f"request {i} {req}: warm differs from cold"
        assert batched[i][:2] == cold[i][:2], f"request {i} {req}: batched differs from cold"
