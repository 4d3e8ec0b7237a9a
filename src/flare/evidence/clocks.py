"""Clock domains: a duration is only ever computed inside one domain.

Two domains exist in a packet:
- `client_monotonic_ns`: `time.monotonic_ns()` in the harness process (send time, the
  receive time of each SSE event);
- `server_monotonic_ns`: the server's own monotonic clock, as the server reports it in its
  `flare` response extension (arrival, scheduled, first token, finished).

Values of the two are never subtracted from one another, even when both happen to read the
same machine clock: the server may be remote, and the packet must not depend on it.
"""

from __future__ import annotations

from dataclasses import dataclass

CLIENT = "client_monotonic_ns"
SERVER = "server_monotonic_ns"
DOMAINS = (CLIENT, SERVER)


class ClockDomainError(ValueError):
    """A duration was asked for across two clock domains, or a timestamp has the wrong or
    no domain label."""


@dataclass(frozen=True)
class Stamp:
    """A timestamp in nanoseconds, labelled with its clock domain."""

    domain: str
    ns: int

    def __post_init__(self) -> None:
        if self.domain not in DOMAINS:
            raise ClockDomainError(f"unknown clock domain {self.domain!r}; known: {DOMAINS}")
        if isinstance(self.ns, bool) or not isinstance(self.ns, int):
            raise ClockDomainError(f"timestamp in {self.domain} must be an integer of ns, "
                                   f"got {self.ns!r}")


def span(start: Stamp, end: Stamp) -> int:
    """`end - start` in ns, both in the same domain.

    Raises:
        ClockDomainError: the two stamps are in different domains.
    """
    if start.domain != end.domain:
        raise ClockDomainError(f"refusing a duration across clock domains: from {start.domain} "
                               f"to {end.domain}")
    return end.ns - start.ns


def domain_of_path(path: str) -> str | None:
    """The clock domain of a field path used in metric definitions ("client.send_ns",
    "server.timings.first_token_ns"); None when the path names no known block."""
    head = path.split(".", 1)[0].split("[", 1)[0]
    return {"client": CLIENT, "server": SERVER}.get(head)
