"""Capacity plan and memory report: sized once at prepare time, allocated once at serve time.

Serve allocates exactly what the plan says (`num_pages` KV pages of `page_size` tokens),
so the memory report written by prepare is the memory serve will use for its pools.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from flare.models.config import ModelConfig
from flare.models.recipe import StateLayout, state_layout

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


@dataclass(frozen=True)
class CapacityPlan:
    """How much a served package can hold at once.

    Attributes:
        max_seq_len: most tokens (prompt + completion) of one sequence.
        max_num_seqs: most sequences in one decode batch.
        page_size: tokens per KV page.
        num_pages: KV pages in the pool (shared by all sequences).
        max_batch_tokens: most tokens computed in one engine step (chunked prefill budget).
        dtype: serving dtype name of weights and KV pool ("float32", ...).
    """

    max_seq_len: int
    max_num_seqs: int
    page_size: int
    num_pages: int
    max_batch_tokens: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "max_num_seqs", "page_size", "num_pages", "max_batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"capacity plan: {name} must be >= 1, got {getattr(self, name)}")
        dtype_from_name(self.dtype)

    @property
    def pages_per_seq(self) -> int:
        """Pages a sequence of `max_seq_len` tokens needs (ceil division)."""
        return -(-self.max_seq_len // self.page_size)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CapacityPlan":
        return cls(**d)


@dataclass(frozen=True)
class MemoryReport:
    """Bytes the served package will hold, against what the device has.

    Attributes are bytes. `workspace_bytes` estimates activations and logits of one step
    of `max_batch_tokens` tokens (fp32 logits for each sequence's last token, plus
    hidden/MLP activations); `device_bytes` is total device memory (host RAM on CPU).
    """

    weights_bytes: int
    kv_pool_bytes: int
    workspace_bytes: int
    total_bytes: int
    device_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_plan(
    config: ModelConfig,
    *,
    max_seq_len: int | None = None,
    max_num_seqs: int = 8,
    page_size: int = 16,
    num_pages: int | None = None,
    max_batch_tokens: int = 512,
    dtype: str = "float32",
) -> CapacityPlan:
    """Size a plan. Defaults: max_seq_len = the model's context (at most 8,192 tokens);
    num_pages = enough for `max_num_seqs` sequences of `max_seq_len` tokens.

    Raises:
        ValueError: a value out of range, naming it.
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
    return CapacityPlan(
        max_seq_len=max_seq_len,
        max_num_seqs=max_num_seqs,
        page_size=page_size,
        num_pages=num_pages,
        max_batch_tokens=max_batch_tokens,
        dtype=dtype,
    )


def layout_for(config: ModelConfig, plan: CapacityPlan) -> StateLayout:
    return state_layout(config, plan.page_size, dtype_from_name(plan.dtype))


def memory_report(
    config: ModelConfig, plan: CapacityPlan, weights_bytes: int, device_bytes: int
) -> MemoryReport:
    """Bytes for weights, KV pool and one step's workspace.

    Raises:
        ValueError: the total exceeds `device_bytes`, naming every figure.
    """
    layout = layout_for(config, plan)
    kv = layout.bytes_per_page * plan.num_pages
    elem = layout.kv_bytes_per_token // (2 * layout.num_kv_layers * layout.num_kv_heads
                                         * layout.head_dim)
    act = plan.max_batch_tokens * (4 * config.hidden_size + 3 * config.intermediate_size) * elem
    logits = plan.max_num_seqs * config.vocab_size * 4
    workspace = act + logits
    total = weights_bytes + kv + workspace
    report = MemoryReport(weights_bytes, kv, workspace, total, device_bytes)
    if total > device_bytes:
        raise ValueError(
            f"plan does not fit: weights {weights_bytes:,} + KV pool {kv:,} "
            f"({plan.num_pages} pages x {layout.bytes_per_page:,} B) + workspace {workspace:,} "
            f"= {total:,} bytes > device {device_bytes:,} bytes"
        )
    return report
