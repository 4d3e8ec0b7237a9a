"""The engine: a step loop of schedule -> forward -> sample -> post-process.

The engine owns the model, the KV cache and the page pool (and, for hybrid recipes, the
state-slot pool and its checkpoints), and runs in one thread. Requests and aborts arrive
through a thread-safe inbox; outputs leave through a callback (`on_output`), which the
async wrapper turns into per-request queues.

What is published when (docs/session-state.md): after each step, the full pages it
completed go to the prefix index and, for hybrid recipes, a checkpoint of the state slot is
taken at the end of a prompt, one token before it (the scheduler ends a chunk there: the
endpoint a repeat of the same prompt adopts, as it must compute one token for logits) and
at each multiple of the checkpoint interval of a prefill;
when a sequence finishes, its partly filled last page and a checkpoint at its last computed
position.
"""

from __future__ import annotations

import copy
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flare.models.attention import AttentionBatch, DecodeGroup, PrefillChunk
from flare.models.config import ModelConfig
from flare.models.recipe import build_model, recipe_for
from flare.package.plan import CapacityPlan, layout_for
from flare.runtime.cuda_graphs import DecodeRunner, GraphPlan
from flare.runtime.detokenize import IncrementalDetokenizer
from flare.runtime.request import GenerationRequest, RequestOutput, RequestTimings
from flare.runtime.sampling import PenaltyCounts, TokenHistory, sample
from flare.runtime.scheduler import ScheduledChunk, Scheduler
from flare.runtime.sequence import Sequence, SeqStatus
from flare.runtime.stop_strings import StopStringMatcher
from flare.state.admission import CostPolicy, DeviceReuse, ReuseCounters
from flare.state.checkpoints import CheckpointIndex
from flare.state.disk_tier import DiskTier
from flare.state.remote_tier import RemoteSessions, RemoteTier, RemoteTierConfig
from flare.state.pools import KVCache, PagePool
from flare.state.prefix_index import PrefixIndex
from flare.state.sessions import MAX_SESSIONS, SessionPins, SessionRegistry
from flare.state.slots import StateSlotPool
from flare.state.tiers import TierStore
from flare.state.transfer import TransferQueue

log = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request the engine cannot serve (empty prompt, prompt beyond the plan, a session
    over its pinning budget); `param` and `code` name the field and the reason for an
    API error when known."""

    def __init__(self, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


@dataclass
class _SeqText:
    """Text-side state of a sequence: detokenizer and stop-string matcher."""

    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    stop_ids: frozenset[int]


@dataclass
class EngineCounters:
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: int = 0
    requests_aborted_total: int = 0
    steps_total: int = 0
    failed_steps_total: int = 0
    eager_steps_total: int = 0  # steps run by the eager path (prefill, mixed, fallbacks)
    # requests whose grammar constraint failed mid-generation (finish reason "grammar_error")
    grammar_failures_total: int = 0


class Engine:
    """Serves generation requests from one model over pools sized by a capacity plan.

    Args:
        config: model hyper-parameters (`ModelConfig.from_hf`; hybrid recipes read the
            original config dict it carries).
        plan: capacity plan; the KV pool of `plan.num_pages` pages and, for a hybrid
            recipe, the state pool of `plan.state_slots + plan.checkpoint_slots` slots are
            allocated here, once.
        tensors: Hugging Face-named weights in the plan's dtype.
        tokenizer: transformers tokenizer (for detokenization and EOS ids).
        device: torch device the weights live on.
        namespace: the package id; roots every prefix-index and checkpoint key.
        prefix_cache: reuse published state across requests (KV pages; for hybrid
            recipes endpoints of pages + checkpoints). False: every request computes all.
        cost_policy: the admission cost arm.
        checkpoint_interval: hybrid recipes: override of `plan.checkpoint_interval`
            (tokens between prefill checkpoints; 0: only end of prompt / generation).
        state_dir: folder of the disk tier of endpoint states (None: no disk tier). Its
            records survive a restart and are offered again to the same package only.
        host_tier_bytes, disk_tier_bytes: overrides of the plan's tier budgets (bytes).
        max_pending_transfers: most host<->disk transfer tickets queued at once (more:
            EnqueueRejected).
        write_through: with a disk tier: write each finished sequence's chain and each
            state leaving the device pool to disk in the background (`TierStore`), so a
            killed process restarts with its recent working set. False: states reach
            disk only when the host tier overflows, on a save, an offload to disk or a
            shutdown save (`flare serve --no-write-through`).
        max_pinned_pages: most KV pages the named sessions' latest states may pin on the
            device together (default: a quarter of the pool).
        decode_graphs: run decode-only steps through these fixed-shape buckets
            (`flare.runtime.cuda_graphs`; dense `llama` recipe only). The KV cache then
            gets one padding page more (outside the page pool). On CUDA each bucket is a
            captured CUDA graph (captured here; if capture fails the engine logs it and
            decodes eagerly); on CPU the static step runs eagerly (tests). None: every step
            runs the eager path.
        remote_tier: the Redis remote tier (`flare.state.remote_tier`) shared by the
            replicas of this package; it takes the disk tier's place below the host tier
            (`state_dir` then holds no records), every finished request's state is
            written through to it, and saved session names are published there. None: no
            remote tier.

    Raises:
        ValueError: the plan cannot hold one sequence of `max_seq_len` tokens, or has
            fewer state slots than sequences for a hybrid recipe, or `state_dir` cannot
            be used (another process holds it, not writable), or `decode_graphs` for a
            hybrid recipe.
    """

    def __init__(self, config: ModelConfig, plan: CapacityPlan,
                 tensors: dict[str, torch.Tensor], tokenizer: Any,
                 device: str | torch.device = "cpu", *, namespace: str = "",
                 prefix_cache: bool = True, cost_policy: CostPolicy | None = None,
                 checkpoint_interval: int | None = None,
                 state_dir: str | Path | None = None, host_tier_bytes: int | None = None,
                 disk_tier_bytes: int | None = None, max_pending_transfers: int = 16,
                 write_through: bool = True,
                 max_pinned_pages: int | None = None,
                 decode_graphs: GraphPlan | None = None,
                 remote_tier: RemoteTierConfig | None = None) -> None:
        if plan.num_pages < plan.pages_per_seq:
            raise ValueError(
                f"plan holds {plan.num_pages} pages but one sequence of max_seq_len "
                f"{plan.max_seq_len} needs {plan.pages_per_seq}")
        self.config = config
        self.plan = plan
        self.recipe = recipe_for(config)
        self.layout = layout_for(config, plan)
        self.tokenizer = tokenizer
        # the server thread encodes with `tokenizer` while this thread decodes: a Rust
        # tokenizer mutated by one (padding/truncation settings) raises in the other
        self._detok_tokenizer = copy.deepcopy(tokenizer)
        self.device = torch.device(device)
        self.model = build_model(config, tensors, max_positions=plan.max_seq_len)
        if decode_graphs is not None and self.layout.is_hybrid:
            raise ValueError(f"recipe {self.recipe!r} keeps layer states: it has no static "
                             f"decode step (hybrid recipes decode eagerly)")
        self.kv = KVCache(self.layout, plan.num_pages, self.device,
                          padding_pages=1 if decode_graphs is not None else 0)
        self.decoder: DecodeRunner | None = None
        if decode_graphs is not None:
            self.decoder = DecodeRunner(self.model, self.kv, decode_graphs,
                                        capture=self.device.type == "cuda")
            if self.decoder.capture:
                try:
                    self.decoder.capture_all()
                except RuntimeError:
                    log.exception("serving without CUDA graphs: every decode step eager")
                    self.decoder = None
        self.pool = PagePool(plan.num_pages)
        self.states: StateSlotPool | None = None
        live_slots, ckpt_slots = 0, 0
        if self.layout.is_hybrid:
            if plan.state_slots and plan.state_slots < plan.max_num_seqs:
                raise ValueError(f"plan has {plan.state_slots} state slots for "
                                 f"{plan.max_num_seqs} sequences")
            live_slots = max(plan.state_slots, plan.max_num_seqs)
            ckpt_slots = plan.checkpoint_slots if prefix_cache else 0
            self.states = StateSlotPool(self.layout, live_slots + ckpt_slots, self.device)
        interval = plan.checkpoint_interval if checkpoint_interval is None else checkpoint_interval
        self.reuse_counters = ReuseCounters()
        self.prefix_index: PrefixIndex | None = None
        self.checkpoints: CheckpointIndex | None = None
        reuse = None
        if prefix_cache:
            # the namespace binds cached pages to this package and its page layout
            self.prefix_index = PrefixIndex(self.pool, plan.page_size,
                                            f"{namespace}/{plan.page_size}/{plan.dtype}")
            if self.states is not None:
                self.checkpoints = CheckpointIndex(self.states, ckpt_slots, plan.page_size)
            reuse = DeviceReuse(self.prefix_index, self.kv, cost_policy or CostPolicy(),
                                self.reuse_counters, self.checkpoints)
        self.checkpoint_interval = interval if self.checkpoints is not None else 0
        self._reuse = reuse
        self._wake = threading.Condition()
        self.pins = SessionPins(self.pool, plan.num_pages // 4 if max_pinned_pages is None
                                else max_pinned_pages, self.checkpoints)
        self.tiers: TierStore | None = None
        if reuse is not None:
            self.tiers = self._make_tiers(
                reuse, namespace, state_dir,
                plan.host_tier_bytes if host_tier_bytes is None else host_tier_bytes,
                plan.disk_tier_bytes if disk_tier_bytes is None else disk_tier_bytes,
                max_pending_transfers, remote_tier)
            if self.tiers is not None and isinstance(self.tiers.disk, DiskTier):
                # finished and evicted states reach the state folder in the background
                self.tiers.write_through_on = write_through
        # saved session names live beside the disk tier, under its folder lock; without a
        # disk tier nothing is saved, so nothing is written there
        below = self.tiers.disk if self.tiers is not None else None
        self.remote_tier = below if isinstance(below, RemoteTier) else None
        has_disk = below is not None and self.remote_tier is None
        self.sessions = SessionRegistry(
            Path(state_dir) if has_disk else None, namespace,
            RemoteSessions(self.remote_tier) if self.remote_tier is not None else None)
        self.scheduler = Scheduler(self.pool, plan.page_size, plan.max_num_seqs,
                                   plan.max_batch_tokens, reuse, self.states,
                                   self.checkpoint_interval,
                                   checkpoint_before_prompt_end=self.checkpoints is not None)
        eos = set(config.eos_token_ids)
        if getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.counters = EngineCounters()
        self.on_output: Callable[[RequestOutput], None] = lambda out: None
        self._seqs: dict[str, Sequence] = {}
        self._text: dict[str, _SeqText] = {}
        self._inbox: list[GenerationRequest] = []
        self.num_waiting_peak = 0  # most requests queued at once (stats, case api-queue-burst)
        self._aborts: list[str] = []
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._sampled_logprobs: dict[str, Any] = {}  # this step's, by request (`_run`)
        self.save_state_on_stop = False  # serve --save-state-on-shutdown
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._seed_rng = torch.Generator().manual_seed(0)

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

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    @classmethod
    def from_package(cls, package: Any, *, cuda_graphs: bool = True,
                     **kwargs: Any) -> "Engine":
        """Build from a `flare.package.reader.LoadedPackage` on the device its tensors
        were loaded onto; `kwargs` as for `Engine`. The manifest's `graph_capture` plan is
        honoured on CUDA unless `cuda_graphs` is False (`flare serve --no-cuda-graphs`).

        Raises:
            As `Engine`; ValueError for an unreadable `graph_capture` entry.
        """
        device = torch.device(kwargs.pop("device", getattr(package.tensors, "device", "cpu")))
        graphs = GraphPlan.from_manifest(package.manifest.graph_capture)
        if graphs is not None and cuda_graphs and device.type == "cuda":
            kwargs.setdefault("decode_graphs", graphs)
        return cls(package.config, package.plan, package.tensors, package.tokenizer,
                   device, namespace=package.manifest.package_id, **kwargs)

    # ---- thread-safe entry points -------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        """Check a request fits the plan before it is queued.

        Raises:
            RequestRejected: empty prompt, or prompt of >= max_seq_len tokens (no room for
                one completion token), naming the numbers.
        """
        n = len(request.prompt_token_ids)
        if n == 0:
            raise RequestRejected("prompt is empty (0 tokens)")
        if n >= self.plan.max_seq_len:
            raise RequestRejected(
                f"prompt has {n} tokens; this package's max sequence length is "
                f"{self.plan.max_seq_len} tokens (prompt plus at least 1 completion token)")
        vocab = self.config.vocab_size
        bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected(f"prompt token id {bad} is outside the vocabulary [0, {vocab})")

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request (any thread). Raises `RequestRejected` as `validate` does."""
        self.validate(request)
        with self._wake:
            self._inbox.append(request)
            # the queue only grows here (and by preemption): its high-water mark, exact
            self.num_waiting_peak = max(self.num_waiting_peak, self.num_waiting)
            self._wake.notify()

    def abort(self, request_id: str) -> None:
        """Cancel a request (any thread); its pages are released at the next step."""
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread between two steps (any thread); its result or
        exception comes back through the returned future. For work on the pools and
        indexes, which only the engine thread may touch (e.g. `offload`, a session save)."""
        fut: Future = Future()
        with self._wake:
            self._commands.append((fn, fut))
            self._wake.notify()
        return fut

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

    def _share(self, seq: Sequence) -> None:
        """With the remote tier: write the state a finished request computed through to
        Redis (the pages it does not hold yet, the tail, checkpoints), so the next turn
        restores there on whichever replica it lands. A refusal (queue full, too big,
        Redis down) costs that replica a recompute, never an error."""
        from flare.state.tiers import SaveRefused

        try:
            self.tiers.save(seq.token_ids[:seq.num_computed])
            self.remote_tier.stats.shares += 1
        except SaveRefused:
            self.remote_tier.stats.share_refused += 1
        except Exception:
            log.exception("writing %s's state through to the remote tier failed",
                          seq.request_id)
            self.remote_tier.stats.share_refused += 1

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
        from flare.state.tiers import SaveRefused

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

    def start(self) -> None:
        """Run the step loop in a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="flare-engine",
                                            daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the step loop (running requests end with "abort"); with
        `save_state_on_stop` and a disk tier, first write every cached state to disk (each
        named session's whole chain included, pinned on the device as it is), so a
        restarted server restores it; without it, send write-through's last records
        (what finished sequences computed is then on disk). Then close the tiers (the
        worker finishes the queued writes first)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self.tiers is None:
            return
        if self.save_state_on_stop and self.tiers.transfers is not None:
            try:
                # pinned states never leave the device by offload
                self.finish_session_saves(self.start_session_saves(wait=60.0))
                self.offload()
                log.info("saved %d state records to disk at shutdown", self.tiers.flush())
            except Exception:  # a failed save costs recomputation later, never the exit
                log.exception("saving state at shutdown failed")
        elif self.tiers.transfers is not None:  # write-through's last records
            self.tiers.transfers.wait_idle(timeout)
            self.tiers.submit_writes(force=True)
        self.tiers.close()
        # the pools stay usable (tests read them after stop) but nothing reaches the tiers
        self.tiers = self._reuse.tiers = self._reuse.index.on_evict = None
        if self.checkpoints is not None:
            self.checkpoints.on_evict = None

    @property
    def num_waiting(self) -> int:
        """Requests queued and not yet running (any thread; no locks taken).

        Never an undercount: a request moves from the inbox to the scheduler's waiting
        queue by being added there first and taken out of the inbox after
        (`_drain_inbox`), and the inbox is read first."""
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

    def run_until_idle(self, requests: list[GenerationRequest]) -> dict[str, list[RequestOutput]]:
        """Run `requests` to completion on the caller's thread; returns each one's outputs.

        For tests, benchmarks and offline use; never while the loop thread runs (`start`).
        Outputs still reach `on_output` as well.
        """
        if self._thread is not None:
            raise RuntimeError("run_until_idle while the engine thread runs")
        outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        forward = self.on_output

        def collect(out: RequestOutput) -> None:
            if out.request_id in outputs:
                outputs[out.request_id].append(out)
            forward(out)

        self.on_output = collect
        try:
            for r in requests:
                self.add_request(r)
            while self._inbox or self._aborts or self._commands or self.scheduler.has_work():
                if not self.step() and self.scheduler.waiting_on_transfers:
                    with self._wake:  # a completed transfer ticket notifies
                        self._wake.wait(0.05)
        finally:
            self.on_output = forward
        return outputs

    # ---- the step loop ------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._inbox or self._aborts or self._commands
                           or (self.scheduler.has_work()
                               and not self.scheduler.waiting_on_transfers)
                           # write-through records held while a write ran: send them
                           or (self.tiers is not None and self.tiers.writes_ready)):
                    # with every request waiting on a transfer ticket, its completion
                    # notifies; the timeout only bounds a missed notification
                    self._wake.wait(0.1 if self.scheduler.has_work() else None)
                if self._stopping:
                    break
            self.step()
        for seq in list(self._seqs.values()):
            self._finish(seq, "abort", error="server shutting down")

    def _drain_inbox(self) -> None:
        with self._wake:
            inbox = list(self._inbox)  # left in the inbox until admitted (`num_waiting`)
            aborts, self._aborts = self._aborts, []
            commands, self._commands = self._commands, []
        for fn, fut in commands:
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # reaches the caller, never the step loop
                    fut.set_exception(exc)
        try:
            for req in inbox:
                self._admit(req)
        finally:
            with self._wake:
                del self._inbox[:len(inbox)]  # later arrivals were appended after these
        for rid in aborts:
            seq = self._seqs.get(rid)
            if seq is not None:
                self._finish(seq, "abort")

    def _admit(self, req: GenerationRequest) -> None:
        p = req.params
        gen = torch.Generator()
        gen.manual_seed(p.seed if p.seed is not None
                        else int(torch.randint(0, 2**62, (1,), generator=self._seed_rng)))
        n = len(req.prompt_token_ids)
        seq = Sequence(request=req, token_ids=list(req.prompt_token_ids), num_prompt_tokens=n,
                       max_len=min(self.plan.max_seq_len, n + p.max_tokens), generator=gen)
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids |= self.eos_token_ids
        self._text[req.request_id] = _SeqText(IncrementalDetokenizer(self._detok_tokenizer),
                                              StopStringMatcher(p.stop), frozenset(stop_ids))
        self._seqs[req.request_id] = seq
        self.counters.prompt_tokens_total += n
        self.scheduler.add(seq)

    def step(self) -> bool:
        """One engine step: take inbox, aborts and commands, schedule, forward, sample, emit
        outputs. Returns False when nothing was scheduled."""
        self._drain_inbox()
        chunks = self.scheduler.schedule()
        if self.tiers is not None:  # what this step's evictions pushed out of the host tier
            self.tiers.submit_writes()
        if not chunks:
            return False
        now = time.monotonic_ns()
        for c in chunks:
            if c.seq.scheduled_ns is None:
                c.seq.scheduled_ns = now
        self.counters.steps_total += 1
        try:
            tokens = self._run(chunks)
        except Exception as exc:  # a failed step fails its requests, never the server
            log.exception("engine step failed")
            self.counters.failed_steps_total += 1
            for c in chunks:
                self._finish(c.seq, "abort", error=f"engine step failed: {exc}")
            return True
        sampled = [c.seq for c in chunks if c.samples]
        for c in chunks:
            seq = c.seq
            before = seq.num_computed
            prefill = seq.is_prefilling or c.num_tokens > 1
            seq.num_computed += c.num_tokens
            self._publish_full_pages(seq)  # after the step: their K/V is written
            if self.checkpoints is not None:  # and the state slot is at num_computed
                n, every = seq.num_computed, self.checkpoint_interval
                if (before < seq.num_prompt_tokens == n  # end of the prompt
                        # one before it: the endpoint of the very same prompt sent again
                        or before < seq.num_prompt_tokens - 1 == n
                        or (prefill and every and n % every == 0)):  # the prefill grid
                    self._checkpoint(seq)
        for seq, tok in zip(sampled, tokens):
            self._append(seq, tok)
        if self.tiers is not None:  # what this step's finishes wrote through
            self.tiers.submit_writes()
        return True

    @torch.inference_mode()
    def _run(self, chunks: list[ScheduledChunk]) -> list[int]:
        """Forward the chunks and sample a token for every chunk that reaches its end.

        A step of single tokens only (decode) goes through the static decode runner when
        there is one and a bucket fits; everything else runs the eager path."""
        sampling = [c.seq for c in chunks if c.samples]
        logits = None
        if self.decoder is not None and all(c.num_tokens == 1 for c in chunks):
            logits = self._run_static(chunks)
            if logits is not None and len(sampling) != len(chunks):
                rows = [i for i, c in enumerate(chunks) if c.samples]
                logits = logits[torch.tensor(rows, device=logits.device)]
        else:
            self.counters.eager_steps_total += 1
            logits = self._run_eager(chunks)
        if logits is None or not sampling:
            return []
        return self._sample(sampling, logits)

    def _run_static(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """One token of each chunk through `self.decoder`: fp32 logits [n, vocab] for all
        n chunks, or, when no bucket fits, the eager path's (counted as a fallback)."""
        ps = self.plan.page_size
        ids, positions, slots, pages, lengths = [], [], [], [], []
        for c in chunks:
            seq, start = c.seq, c.seq.num_computed
            ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(seq.pages[start // ps] * ps + start % ps)
            pages.append(seq.pages)
            lengths.append(start + 1)
        logits = self.decoder.run(ids, positions, slots, pages, lengths)
        if logits is not None:
            return logits
        self.counters.eager_steps_total += 1
        rows = self._run_eager(chunks)  # the sampling chunks' rows only
        if rows is None or len(rows) == len(chunks):
            return rows
        full = rows.new_zeros((len(chunks), rows.shape[-1]))  # back to one row per chunk
        full[torch.tensor([i for i, c in enumerate(chunks) if c.samples],
                          device=rows.device)] = rows
        return full

    def _run_eager(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Forward the chunks with dynamic shapes; fp32 logits [N, vocab] of the N chunks
        that sample (in chunk order), None when none does."""
        # Step metadata is built as Python ints and turned into a few tensors at the end:
        # a decode token costs list appends, not tensor operations.
        ps = self.plan.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []  # cache slot of each decode token
        prefill_slots: list[torch.Tensor] = []  # then each prefill chunk's slots
        decode_seqs: list[Sequence] = []
        prefills, last_rows = [], []
        offset = 0
        in_decode_run = True  # decode tokens lead the flat token list (see AttentionBatch)
        for c in chunks:
            seq, start = c.seq, c.seq.num_computed
            end = start + c.num_tokens
            ids.extend(seq.token_ids[start:end])
            in_decode_run = in_decode_run and c.num_tokens == 1
            if in_decode_run:
                positions.append(start)
                slots.append(seq.pages[start // ps] * ps + start % ps)
                decode_seqs.append(seq)
            else:
                positions.extend(range(start, end))
                gather = self.kv.slots(seq.pages, 0, end)
                prefill_slots.append(gather[start:])
                mask = None
                if start > 0:  # chunk after cached context: causal with an offset
                    mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
                prefills.append(PrefillChunk(offset, c.num_tokens, gather, mask,
                                             seq.state_slot))
            offset += c.num_tokens
            if c.samples:
                last_rows.append(offset - 1)
        decode = None
        if decode_seqs:
            decode = _decode_group(
                [s.pages for s in decode_seqs], [s.num_computed + 1 for s in decode_seqs], ps,
                [s.state_slot for s in decode_seqs] if self.states is not None else None)
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        if prefill_slots:
            slot_mapping = torch.cat([slot_mapping, *prefill_slots])
        batch = AttentionBatch(slot_mapping, decode, tuple(prefills))
        input_ids = torch.tensor(ids, dtype=torch.int64)
        pos = torch.tensor(positions, dtype=torch.int64)
        if self.device.type != "cpu":  # built on the host: one copy each to the device
            batch = _batch_to(batch, self.device)
            input_ids, pos = input_ids.to(self.device), pos.to(self.device)
        if self.states is not None:
            hidden = self.model.forward(input_ids, pos, batch, self.kv, self.states)
        else:
            hidden = self.model.forward(input_ids, pos, batch, self.kv)
        if not last_rows:
            return None
        return self.model.logits(hidden[torch.tensor(last_rows, device=hidden.device)])

    def _sample(self, sampling: list[Sequence], logits: torch.Tensor) -> list[int]:
        """A token for each sequence of `sampling` from its row of fp32 logits [N, vocab]
        (on any device; on a GPU, plain greedy rows are picked there and only the token
        ids cross to the host, otherwise the logits are copied to the host once, where
        the per-request generators live)."""
        if logits.device.type != "cpu" and not all(
                s.request.constraint is None and s.request.params.greedy
                and s.request.params.logprobs is None and not s.request.params.penalized
                and not s.request.params.logit_bias for s in sampling):
            logits = logits.cpu()
        for row, seq in enumerate(sampling):
            constraint = seq.request.constraint
            allowed = constraint.allowed(logits.shape[-1]) if constraint is not None else None
            if allowed is not None:
                logits[row].masked_fill_(~allowed.to(logits.device), float("-inf"))
        vocab = logits.shape[-1]
        for seq in sampling:
            if seq.penalty_counts is None and seq.request.params.penalized:
                seq.penalty_counts = PenaltyCounts(vocab)
        result = sample(logits, [s.request.params for s in sampling],
                        [s.generator for s in sampling],
                        [TokenHistory(s.token_ids, s.num_prompt_tokens, s.penalty_counts)
                         for s in sampling])
        # read by _append/_emit of this step: the logprob goes out with its token
        self._sampled_logprobs = {s.request_id: lp for s, lp in zip(sampling, result.logprobs)
                                  if lp is not None}
        return result.tokens

    def _publish_full_pages(self, seq: Sequence) -> None:
        """List every computed, not yet listed full page of `seq` in the prefix index."""
        index = self.prefix_index
        if index is None:
            return
        ps = self.plan.page_size
        while (len(seq.page_keys) + 1) * ps <= seq.num_computed:
            i = len(seq.page_keys)
            parent = seq.page_keys[-1] if seq.page_keys else index.root
            key, page = index.publish_full(parent, tuple(seq.token_ids[i * ps:(i + 1) * ps]),
                                           seq.pages[i])
            seq.pages[i] = page  # an equal page was already listed: share it
            seq.page_keys.append(key)

    def _publish_tail(self, seq: Sequence) -> None:
        """List the computed part of `seq`'s last, partly filled page (end of prompt or of
        generation), so the next turn can reuse the whole conversation."""
        index = self.prefix_index
        if index is None:
            return
        ps = self.plan.page_size
        i = len(seq.page_keys)
        if i < len(seq.pages) and seq.num_computed > i * ps:
            parent = seq.page_keys[-1] if seq.page_keys else index.root
            index.publish_tail(parent, tuple(seq.token_ids[i * ps:seq.num_computed]),
                               seq.pages[i])

    def _checkpoint(self, seq: Sequence) -> None:
        """Publish a checkpoint of `seq`'s state slot at `seq.num_computed` (hybrid
        recipes; between steps, after the step that produced the state completed). Keyed
        by the chained key of its full pages and the tokens of its partial page. A failed
        copy publishes nothing and never fails the request."""
        ckpts, index = self.checkpoints, self.prefix_index
        p = seq.num_computed
        if ckpts is None or index is None or seq.state_slot < 0 or p == 0:
            return
        ps = self.plan.page_size
        full = p // ps
        if len(seq.page_keys) < full:  # its pages are not all listed: nothing to back it
            return
        parent = seq.page_keys[full - 1] if full else index.root
        try:
            ckpts.publish(parent, tuple(seq.token_ids[full * ps:p]), p, seq.state_slot,
                          self._checkpoint_usable)
        except Exception:
            log.exception("checkpoint of %s at position %d failed", seq.request_id, p)

    def _checkpoint_usable(self, ckpt: Any) -> bool:
        """Whether a checkpoint can still be adopted: its KV pages are listed, or a running
        sequence holds them (its partly filled page is published when it finishes: the
        checkpoints at a prompt's end and the token before it are taken while it runs, and
        must not be the first retired)."""
        if self._reuse.checkpoint_usable(ckpt):
            return True
        ps, p = self.plan.page_size, ckpt.position
        full = p // ps
        for seq in self.scheduler.running:
            if (seq.num_computed >= p and len(seq.page_keys) >= full
                    and (seq.page_keys[full - 1] if full else self.prefix_index.root)
                    == ckpt.parent and tuple(seq.token_ids[full * ps:p]) == ckpt.tail):
                return True
        return False

    def _append(self, seq: Sequence, token: int) -> None:
        """Add a sampled token to `seq`, decide whether it finished, and emit its output."""
        text_state = self._text[seq.request_id]
        if seq.first_token_ns is None:
            seq.first_token_ns = time.monotonic_ns()
        seq.token_ids.append(token)
        self.counters.generation_tokens_total += 1
        constraint = seq.request.constraint
        if token in text_state.stop_ids:
            if seq.request.params.logprobs is not None:  # not part of the text: no logprob
                self._sampled_logprobs.pop(seq.request_id, None)
            self._finish(seq, self._stop_reason(constraint), new_tokens=[token])
            return
        if constraint is not None:
            constraint.advance(token)
        text, stopped = text_state.stops.push(text_state.detok.push(token))
        if stopped or (constraint is not None and constraint.is_done()):
            self._finish(seq, self._stop_reason(constraint), new_tokens=[token], text=text)
        elif len(seq.token_ids) >= seq.max_len:
            self._finish(seq, "length", new_tokens=[token], text=text)
        else:
            self._emit(seq, [token], text)

    def _stop_reason(self, constraint: Any) -> str:
        """"stop", or "grammar_error" when the request's constraint gave up (its output
        is then not what the grammar promised, so it must not end as a clean stop)."""
        if constraint is not None and getattr(constraint, "error", None):
            self.counters.grammar_failures_total += 1
            return "grammar_error"
        return "stop"

    def _finish(self, seq: Sequence, reason: str, *, new_tokens: list[int] | None = None,
                text: str = "", error: str | None = None) -> None:
        if seq.status is SeqStatus.FINISHED:
            return
        text_state = self._text.pop(seq.request_id)
        if reason != "abort" and not text_state.stops.stopped:
            # the sequence ended by length or a stop token: held-back text is final now
            text += text_state.stops.push(text_state.detok.flush())[0]
            text += text_state.stops.flush()
        if error is None:  # a failed step may have left this sequence's last page half written
            self._publish_tail(seq)
            self._checkpoint(seq)  # end of generation: the state at num_computed
            if self.tiers is not None:
                self.tiers.write_through(seq.token_ids[:seq.num_computed])
            if seq.request.session is not None and reason != "abort":
                self._keep_session(seq)
            if self.remote_tier is not None and self.tiers is not None and reason != "abort":
                self._share(seq)
        self.scheduler.finish(seq)
        del self._seqs[seq.request_id]
        seq.finish_reason = reason  # type: ignore[assignment]
        if reason == "abort":
            self.counters.requests_aborted_total += 1
        else:
            self.counters.requests_finished_total += 1
        timings = RequestTimings(seq.request.arrival_ns, seq.scheduled_ns, seq.first_token_ns,
                                 time.monotonic_ns())
        self._emit(seq, new_tokens or [], text, finished=True, timings=timings, error=error)

    def _emit(self, seq: Sequence, tokens: list[int], text: str, *, finished: bool = False,
              timings: RequestTimings | None = None, error: str | None = None) -> None:
        logprobs = None
        if seq.request.params.logprobs is not None:
            # tokens reach _emit only through _append, after _run set the step's logprobs
            lp = self._sampled_logprobs.pop(seq.request_id, None) if tokens else None
            logprobs = (lp,) if lp is not None else ()
        out = RequestOutput(
            request_id=seq.request_id, token_ids=tokens, text=text, finished=finished,
            finish_reason=seq.finish_reason if finished else None,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_completion_tokens=seq.num_completion_tokens,
            num_cached_tokens=seq.num_cached_tokens, timings=timings, error=error,
            reuse=seq.reuse if finished else None, logprobs=logprobs)
        try:
            self.on_output(out)
        except Exception:  # a broken consumer must not stop the step loop
            log.exception("output callback failed for %s", seq.request_id)


def _decode_group(pages: list[list[int]], lengths: list[int], page_size: int,
                  state_slots: list[int] | None = None) -> DecodeGroup:
    """The decode group of B sequences, in a handful of tensor operations whatever B.

    Args:
        pages: each sequence's page table.
        lengths: each sequence's context length in tokens, its new token included.
        page_size: tokens per page.
        state_slots: hybrid recipes: each sequence's state slot; None for KV-only.

    Returns:
        A `DecodeGroup` whose gather is int64 [B, M] (contiguous), M = max(lengths): the
        cache slots of positions 0..M-1; rows of shorter sequences point at slots of page 0
        past their length, and `mask` ([B, 1, 1, M], True = attend) hides them (None when
        every length is M); `lengths` is int64 [B]. For one sequence on consecutive
        pages, `span` is its first slot (attention reads K/V without a gather).
    """
    b, m = len(lengths), max(lengths)
    n = -(-m // page_size)  # pages of the longest sequence
    span = None
    if b == 1 and pages[0][n - 1] - pages[0][0] == n - 1 and (
            pages[0][:n] == list(range(pages[0][0], pages[0][0] + n))):
        span = pages[0][0] * page_size
    table = torch.tensor([p[:n] + [0] * (n - len(p[:n])) for p in pages], dtype=torch.int64)
    offsets = torch.arange(page_size, dtype=torch.int64)
    gather = (table[:, :, None] * page_size + offsets).view(b, n * page_size)[:, :m]
    mask = None
    lens = torch.tensor(lengths, dtype=torch.int64)
    if min(lengths) != m:
        mask = (torch.arange(m)[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, M]
    slots = torch.tensor(state_slots, dtype=torch.int64) if state_slots is not None else None
    return DecodeGroup(b, gather.contiguous(), mask, slots, span, lens)


def _batch_to(batch: AttentionBatch, device: torch.device) -> AttentionBatch:
    """`batch` with every tensor copied to `device` (the eager path builds it on the host)."""
    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    dec = batch.decode
    if dec is not None:
        dec = DecodeGroup(dec.num_seqs, to(dec.gather), to(dec.mask), to(dec.state_slots),
                          dec.span, to(dec.lengths))
    chunks = tuple(PrefillChunk(c.start, c.length, to(c.gather), to(c.mask), c.state_slot)
                   for c in batch.prefills)
    return AttentionBatch(to(batch.slot_mapping), dec, chunks)
