"""`flare chat` driven through a pseudo-terminal (pexpect) against real `flare serve`
processes of the embedded model (issue 20): two streamed turns, /stats with cached tokens
on turn 2, /fork, /switch, Ctrl+C mid-answer, /exit; a restart of the server on the same
state folder resumed from its disk tier; and `flare chat PKG` starting its own server.

Answers are greedy (`--temperature 0`) and short (`--max-tokens`), and the kept
conversation's answer equals the server's non-streamed answer to the same messages.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import httpx
import pexpect
import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\r")
TIMEOUT_S = 180


def flare_script() -> str:
    return str(Path(sys.executable).with_name("flare"))


def spawn(args: list[str], history: Path) -> pexpect.spawn:
    env = dict(os.environ, PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm", COLUMNS="100",
               LINES="40")
    child = pexpect.spawn(flare_script(), ["chat", *args, "--history-dir", str(history),
                                           "--temperature", "0"],
                          env=env, encoding="utf-8", timeout=TIMEOUT_S, dimensions=(40, 100))
    child.logfile_read = open(history / f"pty-{len(list(history.glob('pty-*')))}.log", "w")
    return child


def screen(child: pexpect.spawn) -> str:
    """What came since the last expect, without escape sequences."""
    return ANSI.sub("", child.before or "")


def expect_prompt(child: pexpect.spawn, name: str) -> str:
    """Wait for a new prompt of session `name` (prompt_toolkit turns bracketed paste on
    at each new prompt, not when it redraws the line being typed); returns the screen
    text before it."""
    child.expect(re.compile(r"\x1b\[\?2004h[^>]*?" + re.escape(name) + ">", re.S))
    return screen(child)


def command(child: pexpect.spawn, line: str, prompt: str) -> str:
    child.sendline(line)
    return expect_prompt(child, prompt)


def open_chat(args: list[str], history: Path, session: str) -> tuple[pexpect.spawn, str]:
    """`flare chat ARGS --session SESSION` waited for until its first prompt; returns the
    child and what it printed before the prompt (the server and the session it opened)."""
    chat = spawn([*args, "--session", session], history)
    return chat, expect_prompt(chat, session)


def exit_chat(chat: pexpect.spawn) -> str:
    """/exit and wait for the program to end; returns what it printed on the way out
    (`chat.exitstatus` is set)."""
    chat.sendline("/exit")
    chat.expect(pexpect.EOF)
    out = screen(chat)
    chat.close()
    return out


@pytest.fixture(scope="module")
def state(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("chat")
    (root / "hist").mkdir()
    return {"root": root, "state": root / "state", "hist": root / "hist"}


def serve(package: Path, state: dict, log: str) -> ServerProcess:
    """`flare serve PACKAGE` on the module's state folder, so a later server of the same
    folder finds what this one wrote to the disk tier."""
    return ServerProcess(package, state["root"] / log, ("--state-dir", str(state["state"])))


def wait_running(url: str, timeout_s: float = 120) -> None:
    """Wait until the server runs a request, then a moment more (tokens are streaming)."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(url + "/debug/state", timeout=10).json()["num_running"] == 0:
        assert time.monotonic() < deadline, "the request never ran"
        time.sleep(0.1)
    time.sleep(1.0)


def greedy_answer(url: str, messages: list[dict], max_tokens: int) -> str:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": max_tokens})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_two_turns_stats_fork_switch_interrupt_exit(smollm2_package, state):
    server = serve(smollm2_package, state, "a.log")
    try:
        chat, greeting = open_chat(["--url", server.url, "--max-tokens", "24"], state["hist"],
                                   "s1")
        assert "session s1: new conversation" in greeting
        command(chat, "Name three colours.", "s1")
        first = command(chat, "/stats", "s1")
        assert re.search(r"prompt\s+\d+ tokens, 0 cached", first), first
        command(chat, "And three animals?", "s1")
        second = command(chat, "/stats", "s1")
        cached = re.search(r"prompt\s+(\d+) tokens, (\d+) cached \(from the device", second)
        assert cached and int(cached.group(2)) > 0, second
        assert "time to first token" in second and "tokens/s" in second

        kept = json.loads((state["hist"] / MODEL / "s1.json").read_text())
        msgs = kept["messages"]
        assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant"]
        # what the chat streamed and kept is the server's own greedy answer
        assert msgs[3]["content"] == greedy_answer(server.url, msgs[:3], 24)

        forked = command(chat, "/fork s2", "s2")
        assert "forked s1 into s2" in forked
        assert httpx.get(server.url + "/v1/sessions/s2").status_code == 200
        listing = command(chat, "/sessions", "s2")
        assert "s1" in listing and "s2" in listing
        command(chat, "/switch s1", "s1")
        assert "saved s1" in exit_chat(chat)
        assert chat.exitstatus == 0

        # Ctrl+C mid-answer stops the answer, not the program
        long, _ = open_chat(["--url", server.url, "--ignore-eos", "--max-tokens", "3000",
                             "--plain"], state["hist"], "long")
        long.sendline("Count from one to one thousand.")
        wait_running(server.url)  # the answer streams (a Ctrl+C typed while the prompt
        long.expect(r"\w+ \w+ \w+")  # still reads its line would be a key, not SIGINT)
        long.sendcontrol("c")
        long.expect_exact("[stopped]")
        expect_prompt(long, "long")
        stats = command(long, "/stats", "long")
        assert "finish: interrupted" in stats
        long.sendcontrol("c")  # at the prompt: once asks, twice leaves
        long.expect_exact("Ctrl+C again")
        expect_prompt(long, "long")  # the second at the prompt too, not while it is drawn
        long.sendcontrol("c")
        long.expect(pexpect.EOF)
        long.close()
        assert long.exitstatus == 0
        assert httpx.get(server.url + "/health").status_code == 200
        debug = httpx.get(server.url + "/debug/state").json()
        assert debug["num_running"] == 0 and debug["num_waiting"] == 0
    finally:
        server.stop()


def test_a_new_chat_after_a_server_restart_resumes_from_the_disk_tier(smollm2_package,
                                                                      state):
    if not (state["hist"] / MODEL / "s1.json").is_file():
        pytest.skip("needs the conversation of the test before")
    server = serve(smollm2_package, state, "b.log")
    try:
        chat, greeting = open_chat(["--url", server.url, "--max-tokens", "16"], state["hist"],
                                   "s1")
        assert "session s1: 4 messages" in greeting
        command(chat, "And three fruits?", "s1")
        stats = command(chat, "/stats", "s1")
        cached = re.search(r"(\d+) cached \(from the (\w+)", stats)
        assert cached and int(cached.group(1)) > 0 and cached.group(2) == "disk", stats
        exit_chat(chat)
    finally:
        server.stop()


def test_chat_pkg_starts_and_stops_its_own_server(smollm2_package, state, tmp_path):
    hist = tmp_path / "hist"
    hist.mkdir()
    chat, head = open_chat([str(smollm2_package), "--state-dir", str(tmp_path / "state"),
                            "--max-tokens", "8"], hist, "own")
    url = re.search(r"at (http://127\.0\.0\.1:\d+)", head).group(1)
    command(chat, "Say hello.", "own")
    exit_chat(chat)
    assert chat.exitstatus == 0
    with pytest.raises(httpx.HTTPError):
        httpx.get(url + "/health", timeout=2)
