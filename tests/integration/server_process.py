"""`flare serve` in a child process on a free 127.0.0.1 port, its output in a log file;
shared by the tests that need a real process (signals, restarts)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 90  # load + hash 540 MB on a busy 2-core machine; about 6 s idle
EXIT_TIMEOUT_S = 20


def _flare_command() -> list[str]:
    """The `flare` console script next to this interpreter, else `python -m flare.cli`."""
    script = Path(sys.executable).with_name("flare")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "flare.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`flare serve PKG --host 127.0.0.1 --port <free> [extra_args]`, logged to `log_path`."""

    def __init__(self, package: Path, log_path: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [*_flare_command(), "serve", str(package), "--host", "127.0.0.1",
             "--port", str(self.port), *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"flare serve exited with {code} before /health answered:"
                                   f"\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"flare serve: no /health within {STARTUP_TIMEOUT_S} s:"
                                   f"\n{self.log()}")
            time.sleep(0.2)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after EXIT_TIMEOUT_S; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs (a crash)."""
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()
