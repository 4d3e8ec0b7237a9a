"""The engine: a step loop of schedule -> forward -> sample -> post-process.

The engine owns the model, the KV cache and the page pool (and, for hybrid recipes, the
state-slot pool and its checkpoints), and runs in one thread. Requests and aborts arrive
through a thread-safe inbox; outputs leave through a callback (`on_output`), which the
async wrapper turns into per-request queues.

This module builds the engine (pools, scheduler, model, tiers) and holds its thread-safe
entry points; the rest lives beside it, one job a module:
- `flare.runtime.step_loop`: the step loop (schedule -> run -> sample -> publish -> emit);
- `flare.runtime.forward`: one forward over a step's chunks (static/graph or eager);
- `flare.runtime.engine_state`: tiers, named sessions, pins, offload and saves;
- `flare.runtime.engine_stats`: `stats()`, queue length and the accounting check.

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
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flare.models.config import ModelConfig
from flare.models.recipe import build_model, recipe_for
from flare.package.plan import CapacityPlan, layout_for
from flare.runtime.cuda_graphs import DecodeRunner, GraphPlan
from flare.runtime.engine_state import StateWiring
from flare.runtime.engine_stats import EngineStats
from flare.runtime.forward import ForwardRunner
from flare.runtime.openmp import release_thread_pool
from flare.runtime.request import GenerationRequest, RequestOutput, RequestRejected
from flare.runtime.scheduler import Scheduler
from flare.runtime.sequence import Sequence
from flare.runtime.step_loop import SeqText, StepLoop
from flare.state.admission import CostPolicy, DeviceReuse, ReuseCounters
from flare.state.checkpoints import CheckpointIndex
from flare.state.disk_tier import DiskTier
from flare.state.pools import KVCache, PagePool
from flare.state.prefix_index import PrefixIndex
from flare.state.remote_link import RemoteTierConfig
from flare.state.remote_sessions import RemoteSessions
from flare.state.remote_tier import RemoteTier
from flare.state.sessions import SessionPins, SessionRegistry
from flare.state.slots import StateSlotPool
from flare.state.tiers import TierStore

log = logging.getLogger(__name__)


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


class Engine(StepLoop, ForwardRunner, StateWiring, EngineStats):
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
                                            f"{namespace}/{plan.page_size}/{plan.kv_pool_dtype}")
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
        self._text: dict[str, SeqText] = {}
        self._inbox: list[GenerationRequest] = []
        self.num_waiting_peak = 0  # most requests queued at once (stats, case api-queue-burst)
        self._aborts: list[str] = []
        self._commands: list[tuple[Callable[[], Any], Future]] = []
        self._sampled_logprobs: dict[str, Any] = {}  # this step's, by request (`_run`)
        self.save_state_on_stop = False  # serve --save-state-on-shutdown
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._seed_rng = torch.Generator().manual_seed(0)

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

    def start(self) -> None:
        """Run the step loop in a daemon thread. The calling thread's idle OpenMP workers
        are released first (`openmp.release_thread_pool`): left alive, they make libgomp
        wake every kernel's workers from sleep on the step loop's thread."""
        if self._thread is None:
            release_thread_pool()
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
