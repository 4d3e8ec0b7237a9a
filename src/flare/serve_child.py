"""A `flare serve` child process on a free port of 127.0.0.1, for `flare chat PKG` /
`flare chat --embedded` (`ChildServer`), `flare qualify` (`flare.qualify.server`) and the
tests that need a real process: its command, a free port, the wait until GET /health
answers (or the child exits), and a stop that escalates from a clean signal to SIGKILL.

`ChildServer` writes the child's log to a file (the terminal is the chat's) and runs it in
its own session, so the Ctrl+C that stops an answer does not reach it. On Linux the child
also gets SIGTERM should its parent die without stopping it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 900.0  # --embedded may prepare the package (and build kernels) first
STOP_TIMEOUT_S = 20.0
KILL_WAIT_S = 10.0
POLL_S = 0.25


class ServerStartError(RuntimeError):
    """The child exited, or did not answer /health in time; the message ends with the
    tail of its log."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flare_command() -> list[str]:
    """The `flare` console script beside this interpreter, else `python -m flare.cli`."""
    script = Path(sys.executable).with_name("flare")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "flare.cli"]


def log_tail(log_path: Path, chars: int = 2000) -> str:
    """The last `chars` characters of the child's log ("" when it cannot be read)."""
    try:
        return Path(log_path).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def wait_healthy(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float,
                 started: float | None = None, path: str = "/health",
                 name: str = "flare serve") -> None:
    """Poll GET `url``path` until it answers 200.

    Args:
        proc: the server child (`flare serve`, or a peer server named by `name`).
        url: its base URL, e.g. "http://127.0.0.1:8123".
        log_path: its log, whose tail ends the error messages.
        timeout_s: seconds allowed, counted from `started` (a `time.monotonic()` reading;
            None: now).
        path: what to poll: /health for Flare; a peer without it, e.g. /v1/models.
        name: what the error messages call the child.

    Raises:
        ServerStartError: the child exited first, or `timeout_s` passed (the child is left
            running: stopping it is the caller's).
    """
    deadline = (time.monotonic() if started is None else started) + timeout_s
    while True:
        code = proc.poll()
        if code is not None:
            raise ServerStartError(f"{name} exited with status {code} before it "
                                   f"answered; the end of {log_path}:\n{log_tail(log_path)}")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise ServerStartError(f"{name} did not answer {path} within "
                                   f"{timeout_s:.0f} s; the end of {log_path}:\n"
                                   f"{log_tail(log_path)}")
        time.sleep(POLL_S)


def stop_process(proc: subprocess.Popen,
                 steps: Sequence[tuple[signal.Signals, float]] = (
                     (signal.SIGTERM, STOP_TIMEOUT_S),),
                 kill_wait_s: float = KILL_WAIT_S) -> int:
    """Stop `proc`: each (signal, seconds to wait) of `steps` in turn while it runs, then
    SIGKILL. Returns its exit status (at once when it had already exited)."""
    for sig, wait_s in steps:
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        try:
            return proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        proc.kill()
    return proc.wait(kill_wait_s)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ChildServer:
    """`flare serve TARGET... --host 127.0.0.1 --port <free>` with its output in `log_path`,
    in a session of its own.

    Args:
        serve_args: what follows `flare serve`: a package folder or `--embedded`, and any
            serve options (`--state-dir DIR`, `--num-pages N`, ...).
        log_path: file the child's stdout and stderr go to (its folder is created).
    """

    def __init__(self, serve_args: list[str], log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        linux = sys.platform.startswith("linux")
        self.proc = subprocess.Popen(
            [*flare_command(), "serve", *serve_args, "--host", "127.0.0.1",
             "--port", str(self.port)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if linux else None, start_new_session=not linux)

    def log_tail(self, chars: int = 2000) -> str:
        return log_tail(self.log_path, chars)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until GET /health answers 200.

        Raises:
            ServerStartError: the child exited first, or `timeout_s` passed (then it is
                stopped).
        """
        try:
            wait_healthy(self.proc, self.url, self.log_path, timeout_s)
        except ServerStartError:
            self.stop()
            raise

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit status (idempotent)."""
        code = stop_process(self.proc, ((signal.SIGTERM, timeout_s),))
        if not self._log.closed:
            self._log.close()
        return code
