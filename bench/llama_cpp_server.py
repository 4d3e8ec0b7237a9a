"""llama.cpp's OpenAI-compatible server (llama-cpp-python's `llama_cpp.server`) as a peer.

    with LlamaCppServer(gguf, threads=2, log_path=...) as peer:
        ...  # peer.url answers /v1/completions

starts `python -m llama_cpp.server --model GGUF --host 127.0.0.1 --port <free> --cache
true --n_threads T --n_threads_batch T --n_ctx 8192 --verbose false` (`--cache true`: its
RAM prompt cache, which keeps the KV of earlier prompts for the next one that extends
them; the option names are the ones `python -m llama_cpp.server --help` lists in
llama-cpp-python 0.3.36), waits until /v1/models answers, and stops it on exit (SIGTERM,
then SIGKILL). The server applies its default repeat penalty (1.1); the benchmarks time
the first token, which it does not change.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

import httpx

from flare.serve_child import free_port, log_tail, stop_process


def server_problem() -> str | None:
    """Why llama.cpp's server cannot be started from this interpreter, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install 'llama-cpp-python[server]')"
    missing = [m for m in ("uvicorn", "fastapi", "sse_starlette", "starlette_context",
                           "pydantic_settings") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"llama_cpp.server needs {', '.join(missing)} "
                f"(pip install 'llama-cpp-python[server]')")
    return None


class LlamaCppServer:
    """llama.cpp's server on `gguf` at 127.0.0.1:<free port>, logging to `log_path`.

    A context manager: started on enter (raises RuntimeError, with the log's tail, when
    it exits or is not answering after `startup_timeout` s), stopped on exit.
    """

    def __init__(self, gguf: Path, threads: int, log_path: Path, n_ctx: int = 8192,
                 startup_timeout: float = 120.0) -> None:
        self.gguf, self.threads, self.n_ctx = Path(gguf), threads, n_ctx
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        """The server's command line."""
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(self.gguf),
                "--host", "127.0.0.1", "--port", str(self.port), "--cache", "true",
                "--n_threads", str(self.threads), "--n_threads_batch", str(self.threads),
                "--n_ctx", str(self.n_ctx), "--verbose", "false"]

    def __enter__(self) -> Self:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"llama_cpp.server exited before it answered; the end "
                                   f"of {self.log_path}:\n{log_tail(self.log_path, 600)}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"llama_cpp.server was not answering after "
                           f"{self.startup_timeout:.0f} s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, ((signal.SIGTERM, 10.0),), kill_wait_s=5.0)
