"""Capacity plan and memory report: sized once at prepare time, allocated once at serve time.

Serve allocates exactly what the plan says (`num_pages` KV pages of `page_size` tokens,
and for hybrid recipes `state_slots + checkpoint_slots` state slots), so the memory report
written by prepare is the memory serve will use for its pools.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from flare.models.config import ModelConfig
from flare.models.recipe import model_state_layout, recipe_for
from flare.state.layout import StateLayout

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_from_name(name: str) -> torch.dtype:
    """`torch.dtype` for "float32" / "bfloat16" / "float16".

    Raises:
        ValueError: unknown name, naming it and the known ones.
    """
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# KV pool element types a plan may ask for apart from the serving dtype. float16 halves
# the bytes a decode step streams from the cache; the fused CPU attention widens each
# element exactly as it loads it (kernels/attention.cpp), so the cache's rounding is the
# only difference from a float32 pool, and reuse still equals recompute bit for bit.
KV_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class CapacityPlan:
    """How much a served package can hold at once.

    Attributes:
        max_seq_len: most tokens (prompt + completion) of one sequence.
        max_num_seqs: most sequences in one decode batch.
        page_size: tokens per KV page.
        num_pages: KV pages in the pool (shared by all sequences).
        max_batch_tokens: most tokens computed in one engine step (chunked prefill budget).
        dtype: serving dtype name of weights and activations ("float32", ...), and of
            the KV pool unless `kv_dtype` says otherwise.
        state_slots: live conv/recurrent state slots, one per running sequence of a hybrid
            recipe (= max_num_seqs); 0 for KV-only recipes.
        checkpoint_slots: state slots more, holding checkpoints (copies of a sequence's
            layer states at one position) for reuse; 0 for KV-only recipes.
        checkpoint_interval: a hybrid prefill is cut, and checkpointed, every this many
            tokens (besides the end of each prompt and of each generation); 0 = never.
        host_tier_bytes: bytes of host memory for endpoint states pushed out of the device
            pools (flare.state.tiers); 0 = no host tier.
        disk_tier_bytes: bytes of disk for endpoint states pushed out of the host tier
            (the folder is a serve setting); 0 = no disk tier.
    """

    max_seq_len: int
    max_num_seqs: int
    page_size: int
    num_pages: int
    max_batch_tokens: int
    dtype: str = "float32"
    state_slots: int = 0
    checkpoint_slots: int = 0
    checkpoint_interval: int = 0
    host_tier_bytes: int = 0
    disk_tier_bytes: int = 0
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "max_num_seqs", "page_size", "num_pages", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"capacity plan: {name} must be >= 1, got {getattr(self, name)}")
        for name in ("state_slots", "checkpoint_slots", "checkpoint_interval",
                     "host_tier_bytes", "disk_tier_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"capacity plan: {name} must be >= 0, got {getattr(self, name)}")
        if self.state_slots and self.state_slots < self.max_num_seqs:
            raise ValueError(f"capacity plan: state_slots {self.state_slots} < max_num_seqs "
                             f"{self.max_num_seqs} (every running sequence needs a slot)")
        dtype_from_name(self.dtype)
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"capacity plan: kv_dtype {self.kv_dtype!r} unknown; known: "
                             f"{list(KV_DTYPES)} (or None: the serving dtype)")

    @property
    def kv_pool_dtype(self) -> str:
        """The KV pool's element type: `kv_dtype`, else the serving dtype."""
        return self.kv_dtype or self.dtype

    @property
    def num_state_slots(self) -> int:
        """Slots of the state pool: live sequences plus checkpoints (0 if KV-only)."""
        return self.state_slots + self.checkpoint_slots if self.state_slots else 0

    @property
    def pages_per_seq(self) -> int:
        """Pages a sequence of `max_seq_len` tokens needs (ceil division)."""
        return -(-self.max_seq_len // self.page_size)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["kv_dtype"] is None:  # a pool in the serving dtype: the manifest as before
            del d["kv_dtype"]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CapacityPlan":
        return cls(**d)


@dataclass(frozen=True)
class MemoryReport:
    """Bytes the served package will hold, against what the device has.

    Attributes are bytes. `workspace_bytes` estimates activations and logits of one step
    of `max_batch_tokens` tokens (fp32 logits for each sequence's last token, plus
    hidden/MLP activations); `device_bytes` is total device memory (host RAM on CPU).
    `state_pool_bytes` = `state_slots` (live + checkpoint) x `state_bytes_per_slot`, the
    conv/recurrent state pool of a hybrid recipe (0 for KV-only); `host_tier_bytes` and
    `disk_tier_bytes` are the tiers' budgets; `runtime_bytes` is the resident memory of
    the serving process before it loads a package (Python, torch, Flare's modules;
    `flare.prepare.runtime_base`); `total_bytes` = weights + KV pool + state pool +
    workspace, plus the host tier and the runtime when the device is the host (CPU).
    `graph_workspace_bytes` is the part of `workspace_bytes` that CUDA graph capture adds
    (the KV cache's padding page, the largest graph's gathered K/V, the graphs' static
    inputs and logits; `flare.runtime.cuda_graphs.graph_memory_bytes`); 0 without graphs.
    """

    weights_bytes: int
    kv_pool_bytes: int
    workspace_bytes: int
    total_bytes: int
    device_bytes: int
    state_pool_bytes: int = 0
    state_bytes_per_slot: int = 0
    state_slots: int = 0
    host_tier_bytes: int = 0
    disk_tier_bytes: int = 0
    graph_workspace_bytes: int = 0
    runtime_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Default tier budgets: the host tier holds about 20k tokens of the embedded model's fp32
# KV state (46 KiB a token), the disk tier ten times that.
DEFAULT_HOST_TIER_BYTES = 1 << 30
DEFAULT_DISK_TIER_BYTES = 8 << 30

# Default checkpoint interval of hybrid prefills, in tokens (a multiple of common page
# sizes, so grid checkpoints sit on page boundaries and reuse adopts whole pages).
DEFAULT_CHECKPOINT_INTERVAL = 256


def make_plan(
    config: ModelConfig,
    *,
    max_seq_len: int | None = None,
    max_num_seqs: int = 8,
    page_size: int = 16,
    num_pages: int | None = None,
    max_batch_tokens: int = 512,
    dtype: str = "float32",
    checkpoint_slots: int | None = None,
    checkpoint_interval: int | None = None,
    host_tier_bytes: int = DEFAULT_HOST_TIER_BYTES,
    disk_tier_bytes: int = DEFAULT_DISK_TIER_BYTES,
    kv_dtype: str | None = None,
) -> CapacityPlan:
    """Size a plan. Defaults: max_seq_len = the model's context (at most 8,192 tokens);
    num_pages = enough for `max_num_seqs` sequences of `max_seq_len` tokens. For a hybrid
    recipe: one live state slot per sequence, `checkpoint_slots` = 2 x max_num_seqs and
    `checkpoint_interval` = 256 tokens; for a KV-only recipe all three are 0. Host and disk
    tiers: 1 GiB and 8 GiB. kv_dtype: the KV pool's element type (`KV_DTYPES`), None for
    the serving dtype; naming the serving dtype itself is the same as None.

    Raises:
        ValueError: a value out of range, naming it; `num_pages` too few for one sequence
            of `max_seq_len` tokens (the engine could not serve it); a non-zero
            `checkpoint_slots` or
            `checkpoint_interval` for a KV-only recipe, naming the value and the recipe.
    """
    if max_seq_len is None:
        max_seq_len = min(config.max_position_embeddings, 8192)
    if max_seq_len > config.max_position_embeddings:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}"
        )
    if num_pages is None:
        num_pages = max_num_seqs * -(-max_seq_len // page_size)
    if num_pages < -(-max_seq_len // page_size):  # the engine refuses it: say so at prepare
        raise ValueError(
            f"num_pages {num_pages} cannot hold one sequence of max_seq_len {max_seq_len} "
            f"({-(-max_seq_len // page_size)} pages of {page_size} tokens): raise num_pages "
            f"or lower max_seq_len")
    hybrid = model_state_layout(config, page_size, dtype_from_name(dtype)).is_hybrid
    if hybrid:
        state_slots = max_num_seqs
        if checkpoint_slots is None:
            checkpoint_slots = 2 * max_num_seqs
        if checkpoint_interval is None:
            checkpoint_interval = DEFAULT_CHECKPOINT_INTERVAL
    else:
        given = {k: v for k, v in (("checkpoint_slots", checkpoint_slots),
                                   ("checkpoint_interval", checkpoint_interval)) if v}
        if given:  # a KV-only recipe has no layer state to checkpoint
            raise ValueError(
                f"{', '.join(f'{k}={v}' for k, v in given.items())} given, but recipe "
                f"{recipe_for(config)!r} keeps only KV pages: checkpoint slots and interval "
                f"apply to hybrid recipes (conv/recurrent layer states) only")
        state_slots, checkpoint_slots, checkpoint_interval = 0, 0, 0
    return CapacityPlan(
        max_seq_len=max_seq_len,
        max_num_seqs=max_num_seqs,
        page_size=page_size,
        num_pages=num_pages,
        max_batch_tokens=max_batch_tokens,
        dtype=dtype,
        state_slots=state_slots,
        checkpoint_slots=checkpoint_slots,
        checkpoint_interval=checkpoint_interval,
        host_tier_bytes=host_tier_bytes,
        disk_tier_bytes=disk_tier_bytes,
        # the serving dtype named again is no change: the same plan, the same package
        kv_dtype=None if kv_dtype == dtype else kv_dtype,
    )


def layout_for(config: ModelConfig, plan: CapacityPlan) -> StateLayout:
    """The state layout of the recipe that runs `config`, at the plan's page size and
    dtype (KV-only or hybrid), its KV pool in `plan.kv_pool_dtype`."""
    layout = model_state_layout(config, plan.page_size, dtype_from_name(plan.dtype))
    if plan.kv_dtype is None:
        return layout
    return replace(layout, dtype=dtype_from_name(plan.kv_dtype))


def memory_report(
    config: ModelConfig, plan: CapacityPlan, weights_bytes: int, device_bytes: int,
    host_is_device: bool = True, graph_bytes: int = 0, runtime_bytes: int = 0,
) -> MemoryReport:
    """Bytes for weights, KV pool, state pool and one step's workspace (plus
    `graph_bytes` of CUDA graph capture, counted in the workspace); on CPU
    (`host_is_device`) also the host tier and `runtime_bytes`, the serving process's own
    base (`flare.prepare.runtime_base.runtime_base_bytes`).

    Raises:
        ValueError: the total exceeds `device_bytes`, naming every figure.
    """
    layout = layout_for(config, plan)
    kv = layout.bytes_per_page * plan.num_pages
    elem = dtype_from_name(plan.dtype).itemsize  # activations are in the serving dtype
    act = plan.max_batch_tokens * (4 * config.hidden_size + 3 * config.intermediate_size) * elem
    logits = plan.max_num_seqs * config.vocab_size * 4
    workspace = act + logits + graph_bytes
    per_slot = layout.state_bytes_per_slot
    slots = plan.num_state_slots if layout.is_hybrid else 0
    state = per_slot * slots
    host = plan.host_tier_bytes if host_is_device else 0
    runtime = runtime_bytes if host_is_device else 0
    total = weights_bytes + kv + state + workspace + host + runtime
    report = MemoryReport(weights_bytes, kv, workspace, total, device_bytes,
                          state_pool_bytes=state, state_bytes_per_slot=per_slot,
                          state_slots=slots, host_tier_bytes=plan.host_tier_bytes,
                          disk_tier_bytes=plan.disk_tier_bytes,
                          graph_workspace_bytes=graph_bytes, runtime_bytes=runtime_bytes)
    if total > device_bytes:
        raise ValueError(
            f"plan does not fit: weights {weights_bytes:,} + KV pool {kv:,} "
            f"({plan.num_pages} pages x {layout.bytes_per_page:,} B) + state pool {state:,} "
            f"({slots} slots x {per_slot:,} B) + workspace {workspace:,} "
            f"+ host tier {host:,} + runtime {runtime:,} = {total:,} bytes > device "
            f"{device_bytes:,} bytes"
        )
    return report


def check_plan_keywords(plan_kwargs: Mapping[str, Any]) -> None:
    """Refuse keywords `make_plan` does not take, so `prepare_package` and `write_package`
    (which pass theirs on to it, `make_plan` being the one place that names and defaults
    them) fail before a slow load rather than after.

    Raises:
        TypeError: naming the unknown keywords and the known ones.
    """
    known = [n for n in inspect.signature(make_plan).parameters if n not in ("config", "dtype")]
    unknown = sorted(set(plan_kwargs) - set(known))
    if unknown:
        raise TypeError(f"unknown plan option(s) {', '.join(unknown)}; make_plan takes "
                        f"{', '.join(known)}")
