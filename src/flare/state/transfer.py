"""Transfer tickets: copies between the host and disk tiers, run by one worker thread.

A *ticket* is one copy job with a completion (`Ticket.done`). Reads load disk records
(each verified whole by the disk tier) for a restore; writes store host records on disk
(demotion, an explicit session save). The engine thread submits tickets and never blocks
on them: a request waiting for a restore holds a *waiter* (its request id) on the read
ticket and stays in the waiting queue until the ticket completes.

Rules (ARCHITECTURE.md, "Full conversation state"):
- a request that is cancelled drops its waiter; the copy still finishes for the other
  waiters, and when none is left its result is discarded, never published;
- a read ticket publishes nothing itself: its records reach the host tier only when a
  waiting request takes them (`Ticket.records`), so a half-finished copy is never visible;
- the queue is bounded (`max_pending`): a submission beyond it is refused (the caller
  counts EnqueueRejected) instead of growing without bound;
- two requests waiting for the same records share one read ticket.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flare.state.disk_tier import DiskTier, StateRecord

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Ticket:
    """One copy between tiers.

    Attributes:
        kind: "read" (disk -> host memory) or "write" (host memory -> disk).
        keys: the record keys it copies, in order.
        waiters: request ids waiting for it (reads); empty for fire-and-forget writes.
        done: set once the worker has finished (successfully or not).
        records: reads: key -> the verified record, for each key the disk tier could
            produce (a key missing here was absent, corrupt or rejected).
        written: writes: how many records the disk tier accepted.
        error: why the job failed as a whole, or None.
        touch: writes: keys of stored records to mark used after the writes, in this
            order (the last becomes the most recently used; write-through passes a
            chain deepest first, so the disk tier's LRU drops chain ends before the
            pages they hang from).
        after: writes: called on the worker once the records are written and touched
            (write-through uses it to mark a named session saved only after its chain).
    """

    kind: str
    keys: tuple[bytes, ...]
    waiters: set[str] = field(default_factory=set)
    done: threading.Event = field(default_factory=threading.Event)
    records: dict[bytes, "StateRecord"] = field(default_factory=dict)
    written: int = 0
    error: str | None = None
    payload: tuple["StateRecord", ...] = ()
    touch: tuple[bytes, ...] = ()
    after: tuple[Callable[[], None], ...] = ()


@dataclass
class TransferStats:
    """Counters (ints) of the transfer queue."""

    reads_submitted: int = 0
    reads_shared: int = 0  # a second request joined an in-flight read as a waiter
    reads_discarded: int = 0  # completed with no waiter left: result dropped unpublished
    writes_submitted: int = 0
    records_read: int = 0
    records_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    enqueue_rejected: int = 0
    failures: int = 0


class TransferQueue:
    """A bounded FIFO of tickets served by one daemon worker thread.

    Args:
        disk: the disk tier the worker reads from and writes to (thread-safe).
        max_pending: most tickets queued or running at once; more are refused.
        on_complete: called on the worker thread after each ticket completes (the
            engine uses it to wake its step loop).
    """

    def __init__(self, disk: "DiskTier", max_pending: int = 16,
                 on_complete: Callable[[], None] = lambda: None) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.disk = disk
        self.max_pending = max_pending
        self.on_complete = on_complete
        self.stats = TransferStats()
        self._lock = threading.Lock()
        self._pending: list[Ticket] = []  # queued or running, in submission order
        self._jobs: queue.Queue[Ticket | None] = queue.Queue()
        self._worker = threading.Thread(target=self._run, name="flare-transfer", daemon=True)
        self._worker.start()

    # ---- submit (engine thread) ---------------------------------------------------------

    def read(self, keys: tuple[bytes, ...], waiter: str) -> Ticket | None:
        """A read ticket for `keys` with `waiter` on it: an in-flight ticket for the same
        keys is shared. Returns None when the queue is full (nothing is queued)."""
        with self._lock:
            for t in self._pending:
                if t.kind == "read" and t.keys == keys and not t.done.is_set():
                    t.waiters.add(waiter)
                    self.stats.reads_shared += 1
                    return t
            if len(self._pending) >= self.max_pending:
                self.stats.enqueue_rejected += 1
                return None
            ticket = Ticket("read", keys, {waiter})
            self._pending.append(ticket)
            self.stats.reads_submitted += 1
        self._jobs.put(ticket)
        return ticket

    def write(self, records: list["StateRecord"], waiter: str | None = None,
              touch: tuple[bytes, ...] = (),
              after: tuple[Callable[[], None], ...] = ()) -> Ticket | None:
        """A write ticket storing `records` on disk, in order (parents before children),
        then marking the stored records of `touch` used, in that order (`Ticket.touch`),
        then calling each of `after` (`Ticket.after`). Returns None when the queue is
        full (nothing is called then)."""
        with self._lock:
            if len(self._pending) >= self.max_pending:
                self.stats.enqueue_rejected += 1
                return None
            ticket = Ticket("write", tuple(r.key for r in records),
                            {waiter} if waiter else set(), payload=tuple(records),
                            touch=tuple(touch), after=tuple(after))
            self._pending.append(ticket)
            self.stats.writes_submitted += 1
        self._jobs.put(ticket)
        return ticket

    def drop_waiter(self, ticket: Ticket, waiter: str) -> None:
        """Remove a cancelled (or served) request's waiter. A completed ticket left with no
        waiter is forgotten: its records are dropped unpublished."""
        with self._lock:
            ticket.waiters.discard(waiter)
            if ticket.done.is_set() and not ticket.waiters and ticket.kind == "read":
                ticket.records = {}

    def pending_writes(self) -> list["StateRecord"]:
        """Records queued for disk and not yet written (a lookup may still use them)."""
        with self._lock:
            return [r for t in self._pending if t.kind == "write" for r in t.payload]

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    @property
    def num_pending_writes(self) -> int:
        """Write tickets queued or running."""
        with self._lock:
            return sum(t.kind == "write" for t in self._pending)

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until every submitted ticket completed (tests, shutdown). Returns False on
        timeout."""
        with self._lock:
            tickets = list(self._pending)
        return all(t.done.wait(timeout) for t in tickets)

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued tickets, then stop the worker."""
        self._jobs.put(None)
        self._worker.join(timeout)

    # ---- worker -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            ticket = self._jobs.get()
            if ticket is None:
                return
            try:
                if ticket.kind == "read":
                    self._read(ticket)
                else:
                    self._write(ticket)
            except Exception as exc:  # a failed copy fails its ticket, never the worker
                log.exception("transfer %s of %d records failed", ticket.kind, len(ticket.keys))
                ticket.error = str(exc)
                ticket.records = {}
                with self._lock:
                    self.stats.failures += 1
            with self._lock:
                self._pending.remove(ticket)
                if ticket.kind == "read" and not ticket.waiters:
                    ticket.records = {}
                    self.stats.reads_discarded += 1
                ticket.payload = ()
                ticket.done.set()
            try:
                self.on_complete()
            except Exception:
                log.exception("transfer completion callback failed")

    def _read(self, ticket: Ticket) -> None:
        out: dict[bytes, StateRecord] = {}
        for key in ticket.keys:
            rec = self.disk.get(key)
            if rec is None:  # absent or rejected whole: the restore stops before it
                break
            out[key] = rec
            with self._lock:
                self.stats.records_read += 1
                self.stats.bytes_read += rec.nbytes
        ticket.records = out

    def _write(self, ticket: Ticket) -> None:
        for rec in ticket.payload:
            if self.disk.put(rec):
                ticket.written += 1
                with self._lock:
                    self.stats.records_written += 1
                    self.stats.bytes_written += rec.nbytes
        if ticket.touch:
            self.disk.touch_many(list(ticket.touch))
        for fn in ticket.after:  # tickets run in order: every earlier write is done too
            try:
                fn()
            except Exception:
                log.exception("write completion callback failed")
