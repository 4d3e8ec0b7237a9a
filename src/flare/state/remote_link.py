"""The connection to Redis that the remote tier, its session names and stored responses
share, with one fault policy.

Every call has a short socket timeout (`RemoteTierConfig.timeout_s`). A failure marks the
link down (logged once, counted): while down, calls raise `_Down` at once without
touching the network, so each caller answers its "absent" default and serving goes on
without Redis (recompute, never an error); a monitor thread pings every
`ping_interval_s` and marks the link up again when Redis answers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteTierConfig:
    """Where and how big the remote tier is (`flare serve --remote-tier ...`).

    Attributes:
        url: `redis://[user:password@]HOST:PORT/DB` or `rediss://...` (TLS).
        password: overrides a password in the URL (None: the URL's, or none).
        budget_bytes: most bytes of records kept in Redis for this package and layout
            (give every replica the same figure: each enforces its own on its writes).
        timeout_s: socket connect and command timeout, seconds.
        ping_interval_s: while down, how often the monitor retries, seconds.
        tls_ca: a CA file for `rediss://` (None: the system's).

    Raises:
        ValueError: a URL that is not redis:// or rediss://, a budget < 0, a timeout <= 0.
    """

    url: str
    password: str | None = None
    budget_bytes: int = 1 << 30
    timeout_s: float = 0.25
    ping_interval_s: float = 1.0
    tls_ca: str | None = None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise ValueError(f"--remote-tier must be redis://HOST:PORT/DB or "
                             f"rediss://HOST:PORT/DB, got {self.redacted()!r}")
        if self.budget_bytes < 0:
            raise ValueError(f"remote tier budget must be >= 0 bytes, got {self.budget_bytes}")
        if self.timeout_s <= 0 or self.ping_interval_s <= 0:
            raise ValueError("remote tier timeouts must be > 0 seconds")

    def redacted(self) -> str:
        """The URL with any password replaced by '***' (for logs and errors)."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return parts._replace(netloc=netloc).geturl()


class _Down(Exception):
    """Internal: the tier is down; the caller answers its default."""


class RedisLink:
    """A Redis client with the fault policy of the module docstring.

    Args:
        config: the URL, password and timeouts.
        stats: counters with the fields errors, skipped, outages and reconnects (the
            remote tier's stats).
        client: a ready `redis.Redis` (tests); None: one is made from `config`.

    Never raises because Redis is unreachable: the link starts down and comes up when the
    monitor (`start_monitor`) reaches it.
    """

    def __init__(self, config: RemoteTierConfig, stats: Any,
                 client: object | None = None) -> None:
        self.config = config
        self.stats = stats
        self._lock = threading.Lock()  # counters, state transitions
        self._up = False
        self._closed = threading.Event()
        self._client = client if client is not None else make_client(config)
        self._monitor: threading.Thread | None = None
        self._check()

    def start_monitor(self) -> None:
        """Start the thread that reconnects while the link is down."""
        self._monitor = threading.Thread(target=self._watch, name="flare-remote-tier",
                                         daemon=True)
        self._monitor.start()

    @property
    def up(self) -> bool:
        """Whether Redis answered the last call (False: serving without the tier)."""
        return self._up

    def health(self) -> str:
        """"ok" or "down"."""
        return "ok" if self._up else "down"

    def _check(self) -> bool:
        try:
            self._client.ping()
        except Exception as exc:  # redis.RedisError, OSError: Redis is not there
            self._mark_down(exc)
            return False
        self._mark_up()
        return True

    def _mark_down(self, exc: BaseException) -> None:
        with self._lock:
            self.stats.errors += 1
            was_up, self._up = self._up, False
            if was_up or self.stats.outages == 0:
                self.stats.outages += 1
                log.warning("remote tier %s unreachable (%s): serving without it until it "
                            "answers again", self.config.redacted(), exc)

    def _mark_up(self) -> None:
        with self._lock:
            was_up, self._up = self._up, True
            if not was_up:
                if self.stats.outages:
                    self.stats.reconnects += 1
                log.info("remote tier %s is up", self.config.redacted())

    def _watch(self) -> None:
        while not self._closed.wait(self.config.ping_interval_s):
            if not self._up:
                self._check()

    def _call(self, fn: Callable[[], object]) -> object:
        """Run one Redis call; raises _Down (counted) when the tier is or goes down."""
        if not self._up or self._closed.is_set():
            with self._lock:
                self.stats.skipped += 1
            raise _Down
        try:
            return fn()
        except Exception as exc:  # any client error: the tier is unusable for now
            self._mark_down(exc)
            raise _Down from None

    def close(self) -> None:
        """Stop the monitor and close the connections (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        if self._monitor is not None:
            self._monitor.join(timeout=2)
        try:
            self._client.close()
        except Exception:
            pass


def make_client(config: RemoteTierConfig):
    """A `redis.Redis` from the URL: short timeouts, no retries (a failure marks the tier
    down at once; the monitor reconnects)."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    kwargs = dict(socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s,
                  retry=Retry(NoBackoff(), 0), retry_on_timeout=False,
                  health_check_interval=0)
    if config.password is not None:
        kwargs["password"] = config.password
    if config.url.startswith("rediss://") and config.tls_ca:
        kwargs["ssl_ca_certs"] = config.tls_ca
    return redis.Redis.from_url(config.url, **kwargs)
