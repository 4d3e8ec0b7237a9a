"""Decode steps over fixed-shape buckets, replayed as CUDA graphs on a GPU.

`flare prepare` on CUDA records a *graph plan* in the manifest's `graph_capture`
(`GraphPlan`): the batch-size buckets, the context buckets (pages per sequence) and the
decode attention it measured fastest. At start-up `flare serve` builds a `DecodeRunner`
from that plan, which captures one `torch.cuda.CUDAGraph` per (batch, context) bucket of
`LlamaModel.decode_static` plus the output layer. Graphs are process-local: they are never
written to the package.

Each decode-only engine step whose batch and longest context fit a bucket is run by
copying its inputs into the bucket's static input buffer (one host-to-device copy from
pinned memory) and replaying the graph; its logits stay in the graph's static output until
the next replay. Rows of the bucket past the batch are *padding*: their token is 0 at
position 0, their K/V are written into the KV cache's padding page (`KVCache.padding_page`,
never handed out by the page pool) and their logits are dropped. Prefill and mixed steps,
batches above the largest bucket and contexts above the largest context bucket run the
eager path (`Engine._run`), and are counted.

On CPU there is nothing to capture: the engine normally uses no runner there. Tests build
one with `capture=False`, which runs the very same static function eagerly, so everything
but the capture itself is checked on CPU.

Only the dense `llama` recipe (KV-only) has a static decode step; hybrid recipes decode
eagerly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from flare.models.attention import STATIC_ATTENTION_KINDS
from flare.state.pools import KVCache

log = logging.getLogger(__name__)

# the first context bucket covers this many tokens; each next one 4x more, up to the plan
FIRST_CONTEXT_TOKENS = 256
CONTEXT_GROWTH = 4


@dataclass(frozen=True)
class GraphPlan:
    """What serve captures: one graph per (batch size, context pages) pair.

    Attributes:
        batch_sizes: ascending batch buckets (sequences per decode step), the last one
            max_num_seqs.
        context_pages: ascending context buckets, in pages per sequence (block-table
            width), the last one the plan's pages_per_seq.
        attention: the static decode attention, one of `STATIC_ATTENTION_KINDS`.
    """

    batch_sizes: tuple[int, ...]
    context_pages: tuple[int, ...]
    attention: str = "sdpa"

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "context_pages"):
            vals = getattr(self, name)
            if not vals or any(v < 1 for v in vals) or list(vals) != sorted(set(vals)):
                raise ValueError(f"graph plan: {name} must be ascending distinct integers "
                                 f">= 1, got {list(vals)}")
        if self.attention not in STATIC_ATTENTION_KINDS:
            raise ValueError(f"graph plan: attention {self.attention!r} unknown; known: "
                             f"{list(STATIC_ATTENTION_KINDS)}")

    @property
    def num_graphs(self) -> int:
        return len(self.batch_sizes) * len(self.context_pages)

    def to_manifest(self) -> dict[str, Any]:
        """The manifest's `graph_capture` entry: {"enabled": True, "batch_sizes": [...],
        "context_pages": [...], "attention": ...}."""
        return {"enabled": True, "batch_sizes": list(self.batch_sizes),
                "context_pages": list(self.context_pages), "attention": self.attention}

    @classmethod
    def from_manifest(cls, entry: dict[str, Any]) -> "GraphPlan | None":
        """The plan of a manifest's `graph_capture` entry; None when it is not enabled.

        Raises:
            ValueError: an enabled entry with missing or invalid fields (named).
        """
        if not entry.get("enabled"):
            return None
        try:
            return cls(tuple(int(b) for b in entry["batch_sizes"]),
                       tuple(int(p) for p in entry["context_pages"]),
                       str(entry.get("attention", "sdpa")))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"graph_capture entry {entry!r} unreadable: {exc}") from None


def plan_buckets(max_num_seqs: int, pages_per_seq: int, page_size: int,
                 attention: str = "sdpa") -> GraphPlan:
    """Buckets for a capacity plan: batch 1, 2, 4, 8, ... below max_num_seqs plus
    max_num_seqs itself; context pages covering 256 tokens, then 4x more each, up to
    pages_per_seq (always the last).

    Raises:
        ValueError: a value below 1.
    """
    if min(max_num_seqs, pages_per_seq, page_size) < 1:
        raise ValueError(f"plan_buckets: values must be >= 1, got max_num_seqs="
                         f"{max_num_seqs}, pages_per_seq={pages_per_seq}, "
                         f"page_size={page_size}")
    batches, b = [], 1
    while b < max_num_seqs:
        batches.append(b)
        b *= 2
    batches.append(max_num_seqs)
    pages, p = [], -(-FIRST_CONTEXT_TOKENS // page_size)
    while p < pages_per_seq:
        pages.append(p)
        p *= CONTEXT_GROWTH
    pages.append(pages_per_seq)
    return GraphPlan(tuple(batches), tuple(pages), attention)


def pick_bucket(buckets: tuple[int, ...], n: int) -> int | None:
    """The smallest bucket >= n, or None when n is above every bucket."""
    return next((b for b in buckets if b >= n), None)


@dataclass
class RunnerCounters:
    """Decode steps by how they ran (engine stats, `/metrics`)."""

    graph_replays: int = 0  # replayed a captured graph
    static_eager: int = 0  # ran the static function without a graph (CPU, tests)
    fallbacks: int = 0  # decode-only, but above the largest batch or context bucket


@dataclass
class _Bucket:
    inputs: torch.Tensor  # int64 [B, 4 + P] on the device: ids, positions, slots, lens, table
    staging: torch.Tensor | None  # pinned host copy of `inputs` (CUDA only)
    logits: torch.Tensor | None = None  # float32 [B, V], the graph's static output
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    copied: Any = None  # torch.cuda.Event after the last staging -> inputs copy (CUDA)


@dataclass(eq=False)
class DecodeRunner:
    """Runs decode-only steps of a dense model over a `GraphPlan`'s buckets.

    Args:
        model: a `LlamaModel` (has `decode_static` and `logits`).
        kv: the engine's cache, made with a padding page (`KVCache.padding_page`).
        plan: the buckets and attention.
        capture: capture CUDA graphs (`capture_all`); False runs the static function
            eagerly (CPU; `--no-cuda-graphs` never builds a runner at all).

    Raises:
        ValueError: the cache has no padding page, or `capture` on a non-CUDA cache.
    """

    model: Any
    kv: KVCache
    plan: GraphPlan
    capture: bool = False
    counters: RunnerCounters = field(default_factory=RunnerCounters)

    def __post_init__(self) -> None:
        if self.kv.padding_page is None:
            raise ValueError("the static decode step needs a KV cache with a padding page "
                             "(KVCache(..., padding_pages=1))")
        self.device = self.kv.k.device
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA KV cache, this one is on {self.device}")
        self.page_size = self.kv.page_size
        self.pad_slot = self.kv.padding_page * self.page_size
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        pinned = self.device.type == "cuda"
        for b in self.plan.batch_sizes:
            for p in self.plan.context_pages:
                inputs = torch.empty((b, 4 + p), dtype=torch.int64, device=self.device)
                self._fill_padding(inputs, 0)
                staging = (torch.empty((b, 4 + p), dtype=torch.int64, pin_memory=True)
                           if pinned else None)
                self._buckets[(b, p)] = _Bucket(
                    inputs, staging, copied=torch.cuda.Event() if pinned else None)

    @property
    def num_graphs(self) -> int:
        """Graphs captured (0 until `capture_all` succeeded, or without capture)."""
        return sum(1 for bk in self._buckets.values() if bk.graph is not None)

    def _fill_padding(self, inputs: torch.Tensor, start: int) -> None:
        """Rows start.. of `inputs` as padding: token 0 at position 0, K/V written into
        the padding page, attending to that one slot, block table all padding page."""
        rows = inputs[start:]
        rows[:, 0] = 0
        rows[:, 1] = 0
        rows[:, 2] = self.pad_slot
        rows[:, 3] = 1
        rows[:, 4:] = self.kv.padding_page

    def _step(self, inputs: torch.Tensor) -> torch.Tensor:
        """The static step of one bucket: logits float32 [B, V] for int64 inputs [B, 4+P]."""
        ids = inputs[:, 0].contiguous()
        positions = inputs[:, 1].contiguous()
        slots = inputs[:, 2].contiguous()
        lens = inputs[:, 3].contiguous()
        table = inputs[:, 4:]
        hidden = self.model.decode_static(ids, positions, slots, table, lens, self.kv,
                                          self.plan.attention)
        return self.model.logits(hidden)

    def bucket_for(self, num_seqs: int, max_len: int) -> tuple[int, int] | None:
        """The (batch, context pages) bucket for `num_seqs` rows whose longest context is
        `max_len` tokens (new token included); None when none fits (eager fallback)."""
        b = pick_bucket(self.plan.batch_sizes, num_seqs)
        p = pick_bucket(self.plan.context_pages, -(-max_len // self.page_size))
        return None if b is None or p is None else (b, p)

    def host_inputs(self, key: tuple[int, int], ids: list[int], positions: list[int],
                    slots: list[int], pages: list[list[int]], lengths: list[int]
                    ) -> torch.Tensor:
        """The bucket's inputs as a host int64 tensor [B, 4 + P]: the n real rows, then
        padding rows (`_fill_padding`); block-table entries past a row's pages name the
        padding page."""
        b, p = key
        pad, ps = self.kv.padding_page, self.page_size
        rows = []
        for i, length in enumerate(lengths):
            need = -(-length // ps)
            rows.append([ids[i], positions[i], slots[i], length, *pages[i][:need],
                         *([pad] * (p - need))])
        rows += [[0, 0, self.pad_slot, 1, *([pad] * p)]] * (b - len(lengths))
        return torch.tensor(rows, dtype=torch.int64)

    @torch.inference_mode()
    def run(self, ids: list[int], positions: list[int], slots: list[int],
            pages: list[list[int]], lengths: list[int]) -> torch.Tensor | None:
        """Decode one token for each of n sequences through a bucket.

        Args:
            ids, positions, slots: each sequence's new token, its position and its cache
                slot (n each).
            pages: each sequence's page table (at least ceil(length / page_size) pages).
            lengths: each sequence's context length, its new token included.

        Returns:
            float32 logits [n, vocab] on the device (a view of the graph's static output
            when replayed: read it before the next `run`), or None when no bucket fits
            (the caller runs the eager path; counted in `counters.fallbacks`).
        """
        key = self.bucket_for(len(lengths), max(lengths))
        if key is None:
            self.counters.fallbacks += 1
            return None
        bucket = self._buckets[key]
        host = self.host_inputs(key, ids, positions, slots, pages, lengths)
        n = len(lengths)
        if bucket.graph is not None:
            # the staging buffer's previous copy must have left it before it is
            # overwritten (normally long done: the sampled-token read synchronizes)
            bucket.copied.synchronize()
            bucket.staging.copy_(host)
            bucket.inputs.copy_(bucket.staging, non_blocking=True)
            bucket.copied.record()
            bucket.graph.replay()
            self.counters.graph_replays += 1
            return bucket.logits[:n]
        bucket.inputs.copy_(host)
        self.counters.static_eager += 1
        return self._step(bucket.inputs)[:n]

    @torch.inference_mode()
    def capture_all(self, warmup: int = 2) -> None:
        """Capture one CUDA graph per bucket (largest first, one shared memory pool), after
        `warmup` eager runs of each on a side stream. Every run and the capture see padding
        inputs only, so they write nothing but the padding page.

        Raises:
            RuntimeError: capture failed (what CUDA or torch raised); no graph is kept, so
                the caller can serve eagerly.
        """
        if not self.capture:
            raise RuntimeError("capture_all on a runner made with capture=False")
        keys = sorted(self._buckets, reverse=True)
        try:
            torch.cuda.synchronize(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for key in keys:
                    for _ in range(warmup):
                        self._step(self._buckets[key].inputs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            pool = torch.cuda.graph_pool_handle()
            for key in keys:
                bucket = self._buckets[key]
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._step(bucket.inputs)
                bucket.graph, bucket.logits = graph, logits
            torch.cuda.synchronize(self.device)
        except Exception as exc:
            for bucket in self._buckets.values():
                bucket.graph = bucket.logits = None
            raise RuntimeError(f"CUDA graph capture failed: {exc}") from exc
        log.info("captured %d CUDA graphs: batch sizes %s x context pages %s, attention %s",
                 len(keys), list(self.plan.batch_sizes), list(self.plan.context_pages),
                 self.plan.attention)


def graph_memory_bytes(plan: GraphPlan, *, page_bytes: int, kv_bytes_per_token_layer: int,
                       page_size: int, vocab_size: int) -> int:
    """Device bytes the captured graphs add, estimated: the KV cache's padding page
    (`page_bytes`), the K and V one layer of the largest bucket gathers
    (`kv_bytes_per_token_layer` = K plus V bytes of one token in one layer), and every
    graph's static float32 logits [B, vocab] and int64 inputs [B, 4 + P]."""
    b, p = plan.batch_sizes[-1], plan.context_pages[-1]
    gathered = b * p * page_size * kv_bytes_per_token_layer
    outputs = sum(bb * (vocab_size * 4 + (4 + pp) * 8)
                  for bb in plan.batch_sizes for pp in plan.context_pages)
    return page_bytes + gathered + outputs
