"""Start `flare serve PKG` as a subprocess on a free 127.0.0.1 port, and stop it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from flare.serve_child import ServerStartError, free_port, stop_process, wait_healthy

# SIGINT first: the server's Ctrl+C path, which qualify's restart scenarios exercise
STOP_STEPS = ((signal.SIGINT, 15.0), (signal.SIGTERM, 5.0))


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
        try:
            wait_healthy(self.proc, self.url, self.log_path, self.startup_timeout,
                         started=self._launched)
        except ServerStartError:
            self.stop()
            raise

    def stop(self) -> int | None:
        """Stop the process: SIGINT, then SIGTERM, then SIGKILL, each after a wait.
        Returns its exit status, or None when none was started."""
        proc, self.proc = self.proc, None
        return None if proc is None else stop_process(proc, STOP_STEPS, kill_wait_s=5.0)
