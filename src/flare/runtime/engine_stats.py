"""The engine's statistics and self-checks: queue length, pool occupancy and counters
(`/debug/state`, `/metrics`), and the accounting check tests run. Mixed into
`flare.runtime.engine.Engine`."""

from __future__ import annotations

from flare.runtime.sequence import SeqStatus


class EngineStats:
    """Part of `Engine` (see the module docstring)."""

    @property
    def num_waiting(self) -> int:
        """Requests queued and not yet running (any thread), exact: a request moves from
        the inbox to the scheduler's waiting queue under the inbox lock (`_admit`), and it
        is read under that lock, so it is never counted twice nor missed."""
        with self._wake:
            return len(self._inbox) + len(self.scheduler.waiting)

    def stats(self) -> dict[str, int]:
        """Pool occupancy, queue lengths and counters (a snapshot; ints)."""
        c = self.counters
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": self.num_waiting,
            "num_waiting_peak": self.num_waiting_peak,
            "pages_total": self.pool.num_pages,
            "pages_free": self.pool.num_free,
            "pages_used": self.pool.num_used,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_total": c.prompt_tokens_total,
            # prompt tokens by source: reused from a cache (the host and disk parts, restored
            # into the device first, are also in prompt_tokens_cached_host/disk_total)
            "prompt_tokens_cached_device_total": self.reuse_counters.reused_tokens,
            "generation_tokens_total": c.generation_tokens_total,
            "requests_finished_total": c.requests_finished_total,
            "requests_aborted_total": c.requests_aborted_total,
            "steps_total": c.steps_total,
            "failed_steps_total": c.failed_steps_total,
            "eager_steps_total": c.eager_steps_total,
            "grammar_failures_total": c.grammar_failures_total,
            **self._decoder_stats(),
            "prefix_cache_pages": self.prefix_index.num_pages if self.prefix_index else 0,
            "prefix_cache_evicted_pages_total":
                self.prefix_index.stats.evicted_pages if self.prefix_index else 0,
            "state_slots_capacity": self.states.num_slots if self.states else 0,
            "state_slots_used": self.states.num_used if self.states else 0,
            "checkpoints": len(self.checkpoints) if self.checkpoints else 0,
            "checkpoints_published_total":
                self.checkpoints.stats.published if self.checkpoints else 0,
            "checkpoints_evicted_total":
                self.checkpoints.stats.evicted if self.checkpoints else 0,
            **self.reuse_counters.as_stats(),
            "session_pinned_pages": self.pins.pinned_pages,
            "session_pinned_budget_pages": self.pins.budget_pages,
            **(self.tiers.as_stats() if self.tiers is not None else {}),
        }

    def _decoder_stats(self) -> dict[str, int]:
        """Decode steps by how they ran: replayed CUDA graphs, the static step without a
        graph (CPU tests), decode-only steps that fit no bucket (run eagerly); and the
        graphs held. All 0 without a runner."""
        d = self.decoder
        c = d.counters if d is not None else None
        return {
            "decode_graph_replays_total": c.graph_replays if c else 0,
            "decode_static_eager_total": c.static_eager if c else 0,
            "decode_graph_fallbacks_total": c.fallbacks if c else 0,
            "decode_graphs_captured": d.num_graphs if d is not None else 0,
        }

    def check_integrity(self) -> None:
        """Assert that every page's refcount equals its holders: the sequences whose page
        table lists it, the prefix index and the session pins; that every allocated state slot has exactly
        one holder: a running sequence or a checkpoint (waiting and finished sequences hold
        none); and the pools' and indexes' own invariants.

        Raises:
            AssertionError: naming the first page or slot whose accounting is off.
        """
        self.pool.check_integrity()
        holders = [0] * self.pool.num_pages
        for seq in self._seqs.values():
            for p in seq.pages:
                holders[p] += 1
        if self.prefix_index is not None:
            self.prefix_index.check_integrity()
            for p in self.prefix_index.held_pages():
                holders[p] += 1
        for p in self.pins.held_pages():
            holders[p] += 1
        for p, n in enumerate(holders):
            assert self.pool.refcount(p) == n, (
                f"page {p}: refcount {self.pool.refcount(p)}, holders {n}")
        if self.states is not None:
            self.states.check_integrity()
            slot_holders: list[object] = [None] * self.states.num_slots
            owners: list[tuple[int, object]] = []
            for seq in self._seqs.values():
                if seq.state_slot >= 0:
                    assert seq.status is SeqStatus.RUNNING, (
                        f"{seq.request_id} is {seq.status.value} and holds slot {seq.state_slot}")
                    owners.append((seq.state_slot, seq.request_id))
                else:
                    assert seq.status is not SeqStatus.RUNNING, (
                        f"{seq.request_id} runs without a state slot")
            if self.checkpoints is not None:
                self.checkpoints.check_integrity()
                owners += [(slot, "checkpoint") for slot in self.checkpoints.held_slots()]
            for slot, owner in owners:
                assert slot_holders[slot] is None, (
                    f"state slot {slot} held by {slot_holders[slot]} and {owner}")
                slot_holders[slot] = owner
            for slot, owner in enumerate(slot_holders):
                assert (owner is not None) == self.states.is_allocated(slot), (
                    f"state slot {slot}: allocated {self.states.is_allocated(slot)}, "
                    f"holder {owner}")
        else:
            assert all(seq.state_slot < 0 for seq in self._seqs.values())
        self.reuse_counters.check_conservation()
