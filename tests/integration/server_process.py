"""`flare serve` in a child process on a free 127.0.0.1 port, its output in a log file;
shared by the tests that need a real process (signals, restarts). The child stays in the
test's session (signals are the tests' to send); command, port, readiness wait and stop
are `flare.serve_child`'s.
"""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from flare.serve_child import (
    flare_command,
    free_port,
    log_tail,
    stop_process,
    wait_healthy,
)

STARTUP_TIMEOUT_S = 90  # load + hash 540 MB on a busy 2-core machine; about 6 s idle
EXIT_TIMEOUT_S = 20


class ServerProcess:
    """`flare serve PKG --host 127.0.0.1 --port <free> [extra_args]`, logged to `log_path`;
    returns once /health answers (raises `flare.serve_child.ServerStartError` otherwise)."""

    def __init__(self, package: Path, log_path: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [*flare_command(), "serve", str(package), "--host", "127.0.0.1",
             "--port", str(self.port), *extra_args],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            wait_healthy(self.proc, self.url, log_path, STARTUP_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def log(self) -> str:
        return log_tail(self.log_path, 4000)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after EXIT_TIMEOUT_S; returns the exit status."""
        code = stop_process(self.proc, ((signal.SIGTERM, EXIT_TIMEOUT_S),))
        self._log.close()
        return code

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs (a crash)."""
        self.proc.kill()
        self.proc.wait(10)
        self._log.close()
