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
    """`flare serve PACKAGE --host 127.0.0.1 --port <free> [--state-dir DIR]`, logging to
    `log_path`; `package=None` serves `--embedded` (whose state folder, without `state_dir`,
    is serve's default CACHE_DIR/state).

    Use as a context manager: started on enter (after /health answers), stopped on exit
    (SIGINT, then SIGTERM, then SIGKILL). `restart()` stops it and starts it again on the
    same port and state folder (the log is appended to).
    """

    def __init__(self, package: Path | None, log_path: Path, startup_timeout: float = 180.0,
                 extra_args: tuple[str, ...] = (), state_dir: Path | None = None) -> None:
        self.package = Path(package) if package is not None else None
        self.extra_args = tuple(extra_args)  # more `flare serve` flags
        self.state_dir = Path(state_dir) if state_dir is not None else None
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.launches = 0

    def argv(self) -> list[str]:
        """The command line of the server process."""
        cmd = [sys.executable, "-m", "flare.cli", "serve"]
        cmd += [str(self.package)] if self.package is not None else ["--embedded"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        if self.state_dir is not None:
            cmd += ["--state-dir", str(self.state_dir)]
        return cmd + list(self.extra_args)

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
        log = open(self.log_path, "ab" if self.launches else "wb")
        if self.launches:
            log.write(b"\n--- flare qualify: server restarted ---\n")
            log.flush()
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        log.close()
        self.launches += 1
        self._launched = time.monotonic()

    def restart(self) -> None:
        """Stop the server (gracefully, as `stop`) and start it again: same port, same
        state folder. Raises ServerStartError as `wait_ready`."""
        self.stop()
        self.start()

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

    def stop(self) -> int | None:
        """Stop the process: SIGINT, then SIGTERM, then SIGKILL, each after a wait.
        Returns its exit status, or None when none was started."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        for sig, wait in ((signal.SIGINT, 15), (signal.SIGTERM, 5)):
            proc.send_signal(sig)
            try:
                return proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        proc.kill()
        return proc.wait(5)
