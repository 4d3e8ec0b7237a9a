"""A real uvicorn server over `create_app(make_engine())` on a free 127.0.0.1 port, in a
thread of the test process (the AsyncEngine must be made inside the server's event loop).
Shared by the in-process HTTP tests; real sockets, so client disconnects are real."""

from __future__ import annotations

import asyncio
import socket
import threading
import time


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
