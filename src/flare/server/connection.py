"""The HTTP connection layer: uvicorn's h11 protocol with a header timeout.

uvicorn closes a keep-alive connection that stays idle for `timeout_keep_alive` seconds,
but it has no limit on how long a request's headers may take: a client that opens a
connection and sends nothing, or trickles a header line every few seconds, holds the
connection (and its file descriptor) forever. Production HTTP servers bound this (nginx
`client_header_timeout`, Apache `RequestReadTimeout header=`); `HeaderTimeoutH11Protocol`
does it here: from the moment a connection opens, and again from the end of each response
(the next request on a kept-alive connection), the request's headers must be complete
within `header_timeout_s` seconds, or the server answers 408 `header_timeout` and closes
the connection. A connection on which no byte of a request has arrived by then is idle,
not slow: it is closed without an answer, as nginx closes an idle keep-alive connection,
so a client's pooled connection is never handed an unasked-for 408. The body has its own limit, in the request guard
(`flare.server.guard.RequestGuard`, `body_timeout_s`).

`uvicorn_config` builds the `uvicorn.Config` every Flare server runs with.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_HEADER_TIMEOUT_S = 10.0


def _timeout_response(timeout_s: float) -> bytes:
    body = json.dumps({"error": {
        "message": f"the request headers did not arrive within {timeout_s:g} s "
                   "(flare serve --header-timeout)",
        "type": "invalid_request_error", "param": None, "code": "header_timeout"}}).encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode()
    return head + body


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete
    within `header_timeout_s` seconds (module docstring).

    uvicorn makes one instance per connection with `(config, server_state, app_state)`;
    the timeout comes from the class (`with_timeout` makes a subclass carrying it).
    """

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_timeout(cls, header_timeout_s: float) -> type["HeaderTimeoutH11Protocol"]:
        """A subclass whose connections allow `header_timeout_s` seconds (> 0) for headers.

        Raises:
            ValueError: a timeout that is not a positive number of seconds.
        """
        if not header_timeout_s > 0:
            raise ValueError(f"header timeout must be positive seconds, got {header_timeout_s}")
        return type(cls.__name__, (cls,), {"header_timeout_s": float(header_timeout_s)})

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_timeout)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _on_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.conn.trailing_data[0]:  # part of a request came: it is answered
            self.transport.write(_timeout_response(self.header_timeout_s))
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete: its cycle began
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is not None \
                and self.cycle.response_complete:
            self._arm()  # the next request on this kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def uvicorn_config(app: Any, *, host: str, port: int, log_level: str = "info",
                   header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
                   **kwargs: Any) -> Config:
    """The `uvicorn.Config` of a Flare server: h11 with the header timeout.

    Args:
        app: the ASGI app.
        host, port: where to listen.
        log_level: uvicorn's log level.
        header_timeout_s: seconds a request's headers may take (> 0).
        **kwargs: other `uvicorn.Config` arguments (e.g. `timeout_graceful_shutdown`).

    Raises:
        ValueError: a header timeout that is not positive.
    """
    protocol = HeaderTimeoutH11Protocol.with_timeout(header_timeout_s)
    return Config(app, host=host, port=port, log_level=log_level, http=protocol, **kwargs)
