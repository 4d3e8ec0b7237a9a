"""Helpers for tests that speak HTTP over a raw socket (slow clients, timeouts)."""

from __future__ import annotations

import socket
import time


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends on `sock` until it closes it (at most `limit_s`
    seconds), and how long that took; a reset after the answer ends it too."""
    sock.settimeout(limit_s)
    t0, data = time.monotonic(), b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data, time.monotonic() - t0
