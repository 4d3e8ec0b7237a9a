"""The queue bound `--max-queue`, held at the moment of enqueueing (case api-queue-burst).

`Admission` counts, beside the engine's `num_waiting`, the sequences of requests that have
passed the HTTP guard and are not queued yet; each POST holds a `Ticket` for its share.
`flare.server.guard.RequestGuard` takes the ticket on arrival (429 `queue_full` when there
is none to take) and sets it as `current_ticket` for the request; the engine's enqueue hook
(`flare.runtime.async_engine.on_enqueued`) gives back one share per queued sequence; a
route with `n` choices widens its ticket first (`reserve_choices`).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable

from flare.server.api_error import ApiError


class Admission:
    """The queue bound, held at the moment of enqueueing (case api-queue-burst).

    A POST takes a `Ticket` on arrival when `queue_length() + pending < max_queue`, where
    `pending` counts the sequences of tickets taken and not yet queued; the check and the
    increment run with no await between them, so requests that arrive in the same instant
    cannot all pass on the same reading. A route whose request has `n` choices widens its
    ticket to `n` sequences before queueing them (`reserve_choices`), under the same rule.
    Each sequence queued in the engine gives back its share
    (`flare.runtime.async_engine.on_enqueued`, called right after the engine counts it in
    `num_waiting`); the rest goes back when the request ends without queueing it (a
    refusal, an error, a route that queues nothing). So `num_waiting` never exceeds
    `max_queue`.

    Args:
        queue_length: sequences waiting in the engine now (may be read from any thread).
        max_queue: the bound.
    """

    def __init__(self, queue_length: Callable[[], int], max_queue: int) -> None:
        self.queue_length = queue_length
        self.max_queue = max_queue
        self.pending = 0
        self._lock = threading.Lock()

    def take(self) -> "Ticket | None":
        """A ticket for one sequence, or None when the bound is reached."""
        with self._lock:
            if self.queue_length() + self.pending >= self.max_queue:
                return None
            self.pending += 1
        return Ticket(self)


class Ticket:
    """One request's share of `Admission.pending`: `held` sequences not queued yet.

    Calling the ticket gives back every share it still holds (idempotent); `enqueued`
    gives back one, as one of its sequences is counted in the engine's queue.
    """

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.held = 1
        self._queued = 0  # sequences of this request already counted in num_waiting

    def widen(self, n: int) -> bool:
        """Hold `n` sequences in all (those queued so far included); False, holding what
        it held, when the extra ones would pass the bound."""
        a = self._admission
        with a._lock:
            extra = n - self._queued - self.held
            if extra <= 0:
                return True
            if a.queue_length() + a.pending + extra > a.max_queue:
                return False
            a.pending += extra
            self.held += extra
        return True

    def enqueued(self) -> None:
        """One sequence of this request is now in the engine's queue."""
        with self._admission._lock:
            self._queued += 1
            if self.held:
                self.held -= 1
                self._admission.pending -= 1

    def __call__(self) -> None:
        with self._admission._lock:
            self._admission.pending -= self.held
            self.held = 0


# The ticket of the request being served (set by `flare.server.guard.RequestGuard` for
# POSTs; read by `reserve_choices`).
current_ticket: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar(
    "flare_admission_ticket", default=None)


def reserve_choices(n: int) -> None:
    """Widen the current request's admission ticket to `n` sequences before they are
    queued (a request with `n` choices). No ticket (a route the guard does not cover, a
    test without the guard): nothing to do.

    Raises:
        ApiError: 400 when `n` alone is more than `--max-queue` (it could never be
            queued); 429 `queue_full` when the other sequences would pass it now.
    """
    ticket = current_ticket.get()
    if ticket is None or n <= 1:
        return
    a = ticket._admission
    if n > a.max_queue:
        raise ApiError(400, f"n={n} is more than the server's queue bound of {a.max_queue} "
                       "waiting sequences (--max-queue)", param="n")
    if ticket.widen(n):
        return
    raise ApiError(429, f"n={n} would pass the queue bound of {a.max_queue} waiting "
                   "sequences; retry shortly or ask for fewer choices",
                   type="rate_limit_error", param="n", code="queue_full", retry_after_s=1)
