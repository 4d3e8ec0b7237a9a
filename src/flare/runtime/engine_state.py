"""The engine's state wiring beside its step loop: the host, disk and remote tiers below
the device pools, named sessions and their pins, offload and saves. Mixed into
`flare.runtime.engine.Engine`; every method runs on the engine thread unless it says so."""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path
from typing import Any

from flare.runtime.request import RequestRejected
from flare.runtime.sequence import Sequence
from flare.state.admission import DeviceReuse
from flare.state.disk_tier import DiskTier
from flare.state.remote_link import RemoteTierConfig
from flare.state.remote_tier import RemoteTier
from flare.state.sessions import MAX_SESSIONS
from flare.state.tiers import TierStore
from flare.state.transfer import TransferQueue

log = logging.getLogger(__name__)


class StateWiring:
    """Part of `Engine` (see the module docstring)."""

    def _make_tiers(self, reuse: DeviceReuse, namespace: str, state_dir: str | Path | None,
                    host_bytes: int, disk_bytes: int, max_pending: int,
                    remote: RemoteTierConfig | None = None) -> TierStore | None:
        """The host tier and (with `state_dir`) the disk tier below the device pools, or
        (with `remote`) the Redis remote tier in the disk tier's place, wired to the
        indexes' evictions; None when both budgets are 0 and there is no remote tier."""
        disk = transfers = None
        if remote is not None:
            policy = reuse.policy  # restores from Redis are admitted at its measured speed
            disk = RemoteTier(remote, namespace, json.dumps(self.layout.describe(),
                                                            sort_keys=True),
                              on_bandwidth=lambda bps: policy.bytes_per_s.update(remote=bps))
            policy.bytes_per_s["remote"] = disk.bytes_per_s
            transfers = TransferQueue(disk, max_pending, on_complete=self._notify)
        elif state_dir is not None and disk_bytes > 0:
            layout = json.dumps(self.layout.describe(), sort_keys=True)
            try:
                disk = DiskTier(Path(state_dir), namespace, layout, disk_bytes)
            except (RuntimeError, OSError, sqlite3.Error) as exc:  # in use, unwritable, ...
                raise ValueError(f"state folder {str(state_dir)!r} cannot be used: {exc}") \
                    from None
            transfers = TransferQueue(disk, max_pending, on_complete=self._notify)
        if host_bytes <= 0 and disk is None:
            return None
        tiers = TierStore(reuse.index, self.kv, reuse.policy, max(host_bytes, 0), disk,
                          transfers, self.checkpoints)
        reuse.tiers = tiers
        reuse.index.on_evict = tiers.demote_page
        if self.checkpoints is not None:
            self.checkpoints.on_evict = tiers.demote_checkpoint
        return tiers

    def offload(self) -> int:
        """Engine thread only: move every cached page and checkpoint that no sequence holds
        down to the host tier (and what overflows it to disk). Returns pages released."""
        if self.prefix_index is None:
            return 0
        if self.checkpoints is not None:
            self.checkpoints.clear()
        freed = self.prefix_index.clear()
        if self.tiers is not None:
            self.tiers.submit_writes()
        return freed

    def check_session_budget(self, name: str, num_tokens: int) -> None:
        """Refuse a request naming session `name` whose state of up to `num_tokens` tokens
        could not be pinned within the budget (any thread; reads a counter).

        Raises:
            RequestRejected: naming the pages it needs, those pinned, and the budget.
        """
        need = -(-num_tokens // self.plan.page_size)
        if not self.sessions.has_room(name):
            raise RequestRejected(
                f"session {name!r} would be a new session, and {MAX_SESSIONS} exist already "
                f"(delete one with DELETE /v1/sessions/NAME)", param="session",
                code="too_many_sessions")
        if not self.pins.fits(name, need):
            raise RequestRejected(
                f"session {name!r} would pin up to {need} KV pages; {self.pins.pinned_pages} "
                f"of the {self.pins.budget_pages} pages sessions may pin are in use (delete "
                f"a session with DELETE /v1/sessions/NAME)", param="session",
                code="session_budget_exceeded")

    def _keep_session(self, seq: Sequence) -> None:
        """At a finish: the session's latest state is `seq`'s computed tokens; pin its
        pages (and its end checkpoint) on the device, within the budget."""
        name, n, ps = seq.request.session, seq.num_computed, self.plan.page_size
        self.sessions.record(name, seq.token_ids[:n])
        ckpt = None
        if self.checkpoints is not None and self.prefix_index is not None:
            full = n // ps
            if len(seq.page_keys) >= full:
                parent = seq.page_keys[full - 1] if full else self.prefix_index.root
                ckpt = self.checkpoints.get(parent, tuple(seq.token_ids[full * ps:n]))
        if not self.pins.pin(name, seq.pages[:-(-n // ps)], ckpt):
            log.info("session %s not pinned: over the budget of %d pages", name,
                     self.pins.budget_pages)

    def _write_through(self, seq: Sequence, named: bool) -> None:
        """At a finish: queue the state `seq` computed for the tier below (write-through
        to disk, or shared through Redis), the records it lacks only. A named session
        (`named`) is marked saved once that write is done, so after a crash its name
        comes back with its chain (the session file is replaced atomically). A refusal
        costs a recompute later, never an error."""
        tokens = seq.token_ids[:seq.num_computed]
        on_written = None
        if named:
            name, sessions = seq.request.session, self.sessions

            def on_written(covered: int) -> None:
                if covered:
                    sessions.mark_saved(name, tokens, covered)
        try:
            self.tiers.write_through(tokens, on_written)
        except Exception:
            log.exception("writing %s's state through to the tier below failed",
                          seq.request_id)
            if self.remote_tier is not None:
                self.remote_tier.stats.share_refused += 1
            return
        if self.remote_tier is not None:
            self.remote_tier.stats.shares += 1

    def save_session(self, name: str) -> tuple[Any, int]:
        """Engine thread only (`call`): write session `name`'s state to the disk tier.
        Returns (write ticket or None, positions covered).

        Raises:
            SessionError: no such session; ValueError: this engine has no disk tier.
        """
        tokens = self.sessions.get(name).tokens
        if self.tiers is None or self.tiers.transfers is None:
            raise ValueError("this server has no disk tier (it needs --state-dir, a disk "
                             "tier budget above 0 and the prefix cache on)")
        return self.tiers.save(tokens)

    def start_session_saves(self, wait: float = 0.0) -> list[tuple[str, list[int], Any, int]]:
        """Engine thread only: write every named session's whole chain to the disk tier
        as `save_session` does (its pages, which stay pinned on the device and so are
        never offloaded, and every checkpoint along it). Returns (name, tokens, write
        ticket or None, positions covered) per session handed to the worker, for
        `finish_session_saves`. A session that cannot be saved is logged and skipped;
        `wait` > 0: on a full queue, wait up to that long for it to drain, then once more
        (shutdown; on the step loop it would stall every request)."""
        from flare.state.chain_writes import SaveRefused

        tiers, done = self.tiers, []
        if tiers is None or tiers.transfers is None:
            return done
        for name, session in self.sessions.snapshot().items():
            try:
                try:
                    ticket, covered = tiers.save(session.tokens)
                except SaveRefused:
                    if not wait:
                        raise
                    tiers.transfers.wait_idle(wait)
                    ticket, covered = tiers.save(session.tokens)
            except Exception:
                log.exception("saving session %s failed", name)
                continue
            done.append((name, session.tokens, ticket, covered))
        return done

    def finish_session_saves(self, saves: list[tuple[str, list[int], Any, int]],
                             timeout: float = 60.0) -> int:
        """Any thread: wait up to `timeout` for the writes of `start_session_saves` and
        mark each session whose chain was written whole as saved (it then survives a
        restart by name too). Returns the sessions marked."""
        saved = 0
        for name, tokens, ticket, covered in saves:
            if ticket is not None:
                ticket.done.wait(timeout)
            if covered and (ticket is None or (ticket.done.is_set() and ticket.error is None
                                               and ticket.written == len(ticket.keys))):
                saved += self.sessions.mark_saved(name, tokens, covered)
        return saved
