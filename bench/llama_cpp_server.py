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
from pathlib import Path
from typing import Self

from flare.serve_child import ServerStartError, free_port, stop_process, wait_healthy


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

    A context manager: started on enter (raises `ServerStartError`, a RuntimeError
    ending with the log's tail, when it exits or does not answer /v1/models within
    `startup_timeout` s), stopped on exit.
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
        try:
            wait_healthy(self.proc, self.url, self.log_path, self.startup_timeout,
                         path="/v1/models", name="llama_cpp.server")
        except ServerStartError:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 10 s."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_process(proc, ((signal.SIGTERM, 10.0),), kill_wait_s=5.0)
