"""A `flare serve` child for `flare chat PKG` and `flare chat --embedded`.

The child listens on a free port of 127.0.0.1, writes its log to a file (the terminal is
the chat's), and runs in its own session, so the Ctrl+C that stops an answer does not
reach it. On Linux it also gets SIGTERM should the chat process die without stopping it.
`stop()` sends SIGTERM (the server's clean shutdown) and SIGKILL after a timeout.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 900.0  # --embedded may prepare the package (and build kernels) first
STOP_TIMEOUT_S = 20.0


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


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    os.setsid()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class ChildServer:
    """`flare serve TARGET... --host 127.0.0.1 --port <free>` with its output in `log_path`.

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
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until GET /health answers 200.

        Raises:
            ServerStartError: the child exited first, or `timeout_s` passed.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise ServerStartError(f"flare serve exited with status {code} before it "
                                       f"answered; the end of {self.log_path}:\n"
                                       f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"flare serve did not answer /health within "
                                       f"{timeout_s:.0f} s; the end of {self.log_path}:\n"
                                       f"{self.log_tail()}")
            time.sleep(0.25)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; returns the exit status (idempotent)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode
