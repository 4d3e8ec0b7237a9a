"""A real `redis-server` on a free 127.0.0.1 port with its files in a temp folder, and the
skip rule the remote-tier tests share: skip when redis-server (or smg) is missing, except
in CI (env CI=true), where missing is a failure."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

START_TIMEOUT_S = 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require(executable: str, why: str) -> str:
    """The path of `executable`; skips the test when it is missing (fails in CI)."""
    path = shutil.which(executable) or (
        str(Path(sys.executable).with_name(executable))
        if Path(sys.executable).with_name(executable).is_file() else None)
    if path is None:
        message = f"{executable} is not installed ({why})"
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; CI must install it (.ci/run)")
        pytest.skip(message)
    return path


class RedisProcess:
    """`redis-server` bound to 127.0.0.1 on `port` (a free one by default), no persistence
    files outside `folder`; `stop()` kills it, `start()` starts it again on the same port.

    Args:
        folder: its working folder (dump files, the log).
        password: requirepass, or None.
    """

    def __init__(self, folder: Path, password: str | None = None,
                 port: int | None = None) -> None:
        self.exe = require("redis-server", "apt-get install redis-server")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.exe, "--bind", "127.0.0.1", "--port", str(self.port),
                "--dir", str(self.folder), "--save", "", "--appendonly", "no",
                "--protected-mode", "yes"]
        if self.password:
            args += ["--requirepass", self.password]
        self._log = open(self.folder / "redis.log", "ab")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start: "
                                       + (self.folder / "redis.log").read_text()[-2000:])
                time.sleep(0.05)

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def stop(self) -> None:
        """SIGKILL (a crash: nothing is saved)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None
        self._log.close()
