"""Start `flare serve PKG` as a subprocess on a free 127.0.0.1 port, and stop it."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


class ServerStartError(RuntimeError):
    """The server exited or did not answer /health in time; the message has its log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedServer:
    """`flare serve PACKAGE --host 127.0.0.1 --port <free>`, logging to `log_path`.

    Use as a context manager: started on enter (after /health answers), stopped on exit
    (SIGINT, then SIGTERM, then SIGKILL).
    """

    def __init__(self, package: Path, log_path: Path, startup_timeout: float = 180.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.package = Path(package)
        self.extra_args = tuple(extra_args)  # more `flare serve` flags
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ManagedServer":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def start(self) -> None:
        """`launch` then `wait_ready`."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process; returns at once (the caller may do other work meanwhile)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flare.cli", "serve", str(self.package), "--host",
             "127.0.0.1", "--port", str(self.port), *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        self._launched = time.monotonic()

    def wait_ready(self) -> None:
        """Wait until /health answers 200 (at most `startup_timeout` s after launch).

        Raises:
            ServerStartError: the process exited, or the time ran out (it is stopped).
        """
        assert self.proc is not None, "launch() first"
        deadline = self._launched + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(f"flare serve exited with status {self.proc.returncode}:"
                                       f"\n{self._log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise ServerStartError(f"flare serve did not answer /health within "
                               f"{self.startup_timeout:.0f} s:\n{self._log_tail()}")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 5)):
            proc.send_signal(sig)
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue
        proc.kill()
        proc.wait(5)
