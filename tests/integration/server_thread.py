"""A real uvicorn server over `create_app(make_engine())` on a free 127.0.0.1 port, in a
thread of the test process (the AsyncEngine must be made inside the server's event loop).
Shared by the in-process HTTP tests; real sockets, so client disconnects are real.
`embedded_server` serves the real engine over the embedded model, and
`embedded_server_fixture` makes a test module's `server` fixture of one."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """Starts serving on construction (at most 60 s); `engine` is the AsyncEngine made."""

    def __init__(self, make_engine, settings):
        import uvicorn

        from flare.server.app import create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = None
        self.engine = None

        async def main():
            self.engine = make_engine()
            app = create_app(self.engine, settings, owns_engine=True)
            config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
            self.server = uvicorn.Server(config)
            await self.server.serve()

        self.thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not (self.server and self.server.started):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def embedded_server(checkpoint, *, max_seq_len: int, model: str, package_id: str,
                    **settings) -> ServerThread:
    """A ServerThread over the real Engine of `checkpoint` (the embedded model), planned for
    `max_seq_len` tokens and 4 sequences; `settings` are ServerSettings fields. Use it as a
    context manager (stops on exit) or call `stop()`."""
    from flare.package.plan import make_plan
    from flare.runtime.async_engine import AsyncEngine
    from flare.runtime.engine import Engine
    from flare.server.app import ServerSettings

    plan = make_plan(checkpoint.config, max_seq_len=max_seq_len, max_num_seqs=4)
    engine = Engine(checkpoint.config, plan, checkpoint.tensors, checkpoint.tokenizer)
    return ServerThread(lambda: AsyncEngine(engine, model_name=model, package_id=package_id),
                        ServerSettings(**settings))


def embedded_server_fixture(*, max_seq_len: int, model: str, package_id: str, **settings):
    """A module-scoped fixture `server`: `embedded_server(embedded_checkpoint, ...)` with
    these arguments, stopped after the module. In a test module:
    `server = embedded_server_fixture(max_seq_len=256, model=MODEL, package_id="pkg", max_n=4)`.
    """

    @pytest.fixture(scope="module", name="server")
    def _server(embedded_checkpoint):
        with embedded_server(embedded_checkpoint, max_seq_len=max_seq_len, model=model,
                             package_id=package_id, **settings) as srv:
            yield srv

    return _server
