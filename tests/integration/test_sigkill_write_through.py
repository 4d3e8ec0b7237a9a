"""SIGKILL during a multi-turn workload, 10 times, with write-through on (the default with a
state folder; issue 18, case state-crash-working-set). Real `flare serve` processes on
127.0.0.1, greedy: the tiny random Qwen3 package (KV-only, dense) and a tiny Qwen3.5
package (hybrid: KV pages plus recurrent and conv states).

Each round starts a server on the same `--state-dir` (no flag), resends both
conversations with a new user turn, then kills the server with SIGKILL, in turn:

- after `flare_transfer_pending` and `flare_tier_writes_waiting_records` reach 0
  (write-through had time to write: those turns become *durable*);
- right after the last answer (writes may be in flight);
- while a third request is generating.

After each restart, the first resend of a conversation must restore from disk at least
the durable turn's prompt (a hybrid: its prompt-end checkpoint at P or P - 1, which the
resent history contains), never a record the disk tier rejected, and every answer equals
that of a `--no-prefix-cache` server given the same messages.

A named session (the `session` field) comes back by name after one SIGKILL, with no save
call: write-through marks it saved once its chain is written.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from hybrid_models import save_tiny_qwen3_5  # noqa: E402

pytestmark = pytest.mark.slow
ROUNDS = 10
SYSTEM = {"role": "system", "content": "You are terse."}
USER_TURNS = ["Name a prime.", "And an even one?", "Add them.", "Now double it.",
              "Is it odd?", "Say it in words.", "Count to three.", "Thanks.",
              "One more prime.", "Goodbye."]


def model_of(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def chat(url: str, messages: list[dict], max_tokens: int = 8,
         session: str | None = None) -> dict:
    body = {"model": model_of(url), "messages": messages, "max_tokens": max_tokens,
            "temperature": 0}
    if session is not None:
        body["session"] = session
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("flare_") and " " in line and "{" not in line:
            name, value = line.split()[:2]
            out[name] = float(value)
    return out


def wait_written(url: str, timeout: float = 60.0) -> None:
    """Until write-through has handed everything to disk (two quiet readings)."""
    deadline, quiet = time.monotonic() + timeout, 0
    while quiet < 2:
        m = metrics(url)
        quiet = quiet + 1 if (m["flare_transfer_pending"] == 0
                              and m["flare_tier_writes_waiting_records"] == 0) else 0
        assert time.monotonic() < deadline, "write-through did not finish"
        time.sleep(0.1)


def in_flight(url: str, messages: list[dict]) -> threading.Thread:
    """A streamed request generating when the server is killed (its error is expected)."""
    started = threading.Event()

    def go() -> None:
        body = {"model": model_of(url), "messages": messages, "max_tokens": 64,
                "temperature": 0, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                              timeout=60) as r:
                for _ in r.iter_lines():
                    started.set()
        except httpx.HTTPError:
            pass
        started.set()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    started.wait(30)
    return t


@pytest.fixture(scope="module")
def hybrid_package(tmp_path_factory, embedded_checkpoint) -> Path:
    from flare.prepare.package import prepare_package

    root = tmp_path_factory.mktemp("sigkill-qwen3_5")
    save_tiny_qwen3_5(root / "model", embedded_checkpoint.tokenizer)
    prepare_package(root / "model", root / "pkg", max_seq_len=1024, max_num_seqs=2,
                    progress=False)
    return root / "pkg"


@pytest.fixture(scope="module")
def dense_package(tmp_path_factory, tiny_qwen3_dir) -> Path:
    from flare.prepare.package import prepare_package

    out = tmp_path_factory.mktemp("sigkill-qwen3") / "pkg"  # room for 10 turns
    prepare_package(tiny_qwen3_dir, out, max_seq_len=1024, max_num_seqs=4, progress=False)
    return out


@pytest.fixture(params=["dense", "hybrid"])
def package(request, dense_package, hybrid_package) -> tuple[str, Path]:
    return request.param, dense_package if request.param == "dense" else hybrid_package


def test_sigkill_ten_times_restores_the_written_working_set_equal_to_recompute(
        package, tmp_path):
    kind, pkg = package
    state = tmp_path / "state"
    reference = ServerProcess(pkg, tmp_path / "ref.log", ("--no-prefix-cache",))
    convs: dict[str, list[dict]] = {"a": [SYSTEM], "b": [SYSTEM]}
    durable = {"a": 0, "b": 0}  # prompt tokens of the newest turn known to be on disk
    restored = []
    try:
        for rnd in range(ROUNDS):
            server = ServerProcess(pkg, tmp_path / f"s{rnd}.log", ("--state-dir", str(state)))
            try:
                prompts = {}
                for name, history in convs.items():
                    history.append({"role": "user",
                                    "content": USER_TURNS[(rnd + (name == "b")) % 10]})
                    got = chat(server.url, history)
                    want = chat(reference.url, history)
                    assert got["choices"][0]["message"] == want["choices"][0]["message"], (
                        f"round {rnd}, conversation {name}")
                    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
                    prompts[name] = got["usage"]["prompt_tokens"]
                    bound = durable[name] - (kind == "hybrid")
                    assert cached >= bound, (f"round {rnd}, {name}: cached {cached}, the "
                                             f"durable turn had {durable[name]} prompt tokens")
                    assert cached < prompts[name]
                    restored.append(cached)
                    reply = got["choices"][0]["message"]["content"].strip()
                    history.append({"role": "assistant", "content": reply or "ok"})
                m = metrics(server.url)
                assert all(v == 0 for k, v in m.items()
                           if k.startswith("flare_disk_tier_rejected_")), m
                if rnd % 3 == 0:
                    wait_written(server.url)
                    durable = dict(prompts)
                elif rnd % 3 == 2:
                    in_flight(server.url, convs["a"] + [{"role": "user",
                                                         "content": "Tell a long story."}])
            finally:
                server.kill()
        # the restarts after waited kills (rounds 1, 4, 7) had durable turns to restore
        assert sum(c > 0 for c in restored) >= 6
    finally:
        reference.stop()


def test_a_named_session_survives_sigkill_by_name(dense_package, tmp_path):
    """Two turns naming a session, no save call, then SIGKILL once write-through is done:
    the restarted server knows the name (write-through marked it saved after its chain),
    the next turn restores from disk, and its answer equals a `--no-prefix-cache`
    server's."""
    state = tmp_path / "state"
    reference = ServerProcess(dense_package, tmp_path / "ref.log", ("--no-prefix-cache",))
    history = [SYSTEM]
    try:
        server = ServerProcess(dense_package, tmp_path / "s0.log", ("--state-dir", str(state)))
        try:
            for turn in USER_TURNS[:2]:
                history.append({"role": "user", "content": turn})
                got = chat(server.url, history, session="s")
                reply = got["choices"][0]["message"]["content"].strip()
                history.append({"role": "assistant", "content": reply or "ok"})
            wait_written(server.url)
            before = httpx.get(server.url + "/v1/sessions/s", timeout=10).json()
            assert before["saved_tokens"] == before["tokens"] > 0
        finally:
            server.kill()
        server = ServerProcess(dense_package, tmp_path / "s1.log", ("--state-dir", str(state)))
        try:
            after = httpx.get(server.url + "/v1/sessions/s", timeout=10)
            assert after.status_code == 200, after.text
            assert after.json()["tokens"] == before["tokens"]
            assert after.json()["saved_tokens"] == before["saved_tokens"]
            history.append({"role": "user", "content": USER_TURNS[2]})
            got = chat(server.url, history, session="s")
            want = chat(reference.url, history)
            assert got["choices"][0]["message"] == want["choices"][0]["message"]
            assert got["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        finally:
            server.kill()
    finally:
        reference.stop()
