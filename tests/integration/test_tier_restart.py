"""Restart restore over HTTP: a named session saved to the disk tier survives a SIGKILL of
the server; the restarted server restores it (cached tokens reported) and answers exactly
as a server that computes everything. Real `flare serve` processes on 127.0.0.1 serving
the tiny random Qwen3 package, greedy."""

from __future__ import annotations

import httpx
import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.slow


def chat(url: str, messages: list[dict], session: str | None = None) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    if session:
        body["session"] = session
    body["model"] = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_saved_session_survives_sigkill_and_restores_equal_to_recompute(
        tiny_qwen3_package, tmp_path):
    state = tmp_path / "state"
    turn1 = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "Name three prime numbers and one even number."}]
    first = ServerProcess(tiny_qwen3_package, tmp_path / "a.log",
                          ("--state-dir", str(state)))
    try:
        answer = chat(first.url, turn1, session="agent-1")["choices"][0]["message"]["content"]
        saved = httpx.post(first.url + "/v1/sessions/agent-1/save", timeout=60)
        assert saved.status_code == 200, saved.text
        assert saved.json()["saved_tokens"] > 16
        fork = httpx.post(first.url + "/v1/sessions/agent-1/fork", json={"id": "agent-2"},
                          timeout=10)
        assert fork.status_code == 200 and fork.json()["forked_from"] == "agent-1"
        bad = httpx.post(first.url + "/v1/sessions/bad name!/save", timeout=10)
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_session_name"
        missing = httpx.get(first.url + "/v1/sessions/nobody", timeout=10)
        assert missing.status_code == 404
    finally:
        first.kill()  # a crash: nothing runs at exit

    turn2 = turn1 + [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "Now add them up."}]
    second = ServerProcess(tiny_qwen3_package, tmp_path / "b.log",
                           ("--state-dir", str(state)))
    try:
        info = httpx.get(second.url + "/v1/sessions/agent-1", timeout=10).json()
        assert info["saved_tokens"] == saved.json()["saved_tokens"]
        restored = chat(second.url, turn2, session="agent-1")
        cached = restored["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= 16
        assert metric(second.url, "flare_tier_restores_disk_total") == 1
        bad = httpx.post(second.url + "/v1/state/offload", json={"to": "tape"}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "to"
        off = httpx.post(second.url + "/v1/state/offload", json={"to": "disk"}, timeout=60)
        assert off.status_code == 200, off.text
        assert off.json()["pages_released"] > 0
        # only the pinned session's pages stay on the device
        assert 0 < metric(second.url, "flare_prefix_cache_pages") <= metric(
            second.url, "flare_session_pinned_pages")
    finally:
        second.stop()

    cold = ServerProcess(tiny_qwen3_package, tmp_path / "c.log", ("--no-prefix-cache",))
    try:
        want = chat(cold.url, turn2)
    finally:
        cold.stop()
    assert restored["choices"][0]["message"] == want["choices"][0]["message"]
    assert restored["usage"]["completion_tokens"] == want["usage"]["completion_tokens"]
