"""A saved hybrid session survives a restart even when the client resends its reply with
different tokens (issue 18, case state-hybrid-restart-retokenized). Real `flare serve` processes on 127.0.0.1 serving the tiny
Qwen3.5 and LFM2 packages, greedy:

1. turn 1 (a system message and a user turn of about 300 tokens, 16 answer tokens) in
   session `s`; then `POST /v1/sessions/s/save` (or, second variant, nothing but
   `--save-state-on-shutdown`); SIGTERM;
2. a server restarted on the same `--state-dir` gets turn 2: the history with the reply
   edited near its start (so its tokens differ from the generated ones, as a reply that
   re-tokenizes differently does) and a new user turn.

The restarted server reuses what the never-restarted one reuses (the newest checkpoint at
or below the first differing token: turn 1's prompt end, which the save writes with every
other checkpoint on the session's chain), and answers as a `--no-prefix-cache` server.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from http_helpers import metric
from server_process import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from hybrid_models import save_tiny_lfm2, save_tiny_qwen3_5  # noqa: E402

pytestmark = pytest.mark.slow
SAVERS = {"qwen3_5": save_tiny_qwen3_5, "lfm2": save_tiny_lfm2}


def chat(url: str, messages: list[dict], session: str | None = None) -> dict:
    body = {"model": httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"],
            "messages": messages, "max_tokens": 16, "temperature": 0}
    if session:
        body["session"] = session
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def cached(answer: dict) -> int:
    return answer["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module", params=sorted(SAVERS))
def package(request, tmp_path_factory, embedded_checkpoint) -> Path:
    from flare.prepare.package import prepare_package

    root = tmp_path_factory.mktemp(f"hybrid-restart-{request.param}")
    SAVERS[request.param](root / "model", embedded_checkpoint.tokenizer)
    prepare_package(root / "model", root / "pkg", max_seq_len=1024, max_num_seqs=2,
                    progress=False)
    return root / "pkg"


TURN1 = [{"role": "system", "content": "You are a careful assistant."},
         {"role": "user", "content": "Explain how a recurrent state is carried from one "
                                     "token to the next, step by step. " * 16}]


def turn2_of(reply: str) -> list[dict]:
    cut = max(1, len(reply) // 3)
    edited = reply[:cut] + " amountsobjs " + reply[cut:]  # tokens differ from there on
    return TURN1 + [{"role": "assistant", "content": edited},
                    {"role": "user", "content": "Now the convolution state."}]


@pytest.mark.parametrize("how", ["save", "shutdown"])
def test_restart_restores_the_chain_when_the_reply_retokenizes(package, tmp_path, how):
    state = tmp_path / "state"
    # "save": only the explicit save may reach the disk (write-through off), so the
    # never-restarted figure below is taken on the same server without writing its state
    extra = ("--state-dir", str(state)) + (("--save-state-on-shutdown",)
                                           if how == "shutdown" else ("--no-write-through",))
    first = ServerProcess(package, tmp_path / "a.log", extra)
    try:
        one = chat(first.url, TURN1, session="s")
        assert one["usage"]["prompt_tokens"] > 256  # past the checkpoint grid
        reply = one["choices"][0]["message"]["content"]
        if how == "save":
            saved = httpx.post(first.url + "/v1/sessions/s/save", timeout=60)
            assert saved.status_code == 200, saved.text
            assert saved.json()["saved_tokens"] >= one["usage"]["prompt_tokens"]
        if how == "save":
            # the figure of a server that never restarted (nothing of it reaches the
            # disk: no session, and without the flag nothing is written at exit)
            never = chat(first.url, turn2_of(reply))
    finally:
        first.stop()
    if how == "shutdown":  # here the first server writes everything at exit: ask another
        other = ServerProcess(package, tmp_path / "n.log")
        try:
            assert chat(other.url, TURN1)["choices"][0]["message"]["content"] == reply
            never = chat(other.url, turn2_of(reply))
        finally:
            other.stop()
    assert cached(never) >= one["usage"]["prompt_tokens"]  # turn 1's prompt-end checkpoint

    second = ServerProcess(package, tmp_path / "b.log", ("--state-dir", str(state)))
    try:
        restored = chat(second.url, turn2_of(reply))
        assert metric(second.url, "flare_tier_restores_disk_total") == 1
    finally:
        second.stop()
    assert cached(restored) == cached(never)

    cold = ServerProcess(package, tmp_path / "c.log", ("--no-prefix-cache",))
    try:
        want = chat(cold.url, turn2_of(reply))
    finally:
        cold.stop()
    assert restored["choices"][0]["message"] == want["choices"][0]["message"]
    assert never["choices"][0]["message"] == want["choices"][0]["message"]
