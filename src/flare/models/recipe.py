"""The recipe interface: how one architecture family turns a config into state and a forward.

A recipe declares its *state layout* (what per-sequence state the forward reads and writes)
so that planning, pools and reuse treat KV-only and hybrid models through the same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.models.config import ModelConfig


@dataclass(frozen=True)
class StateLayout:
    """Per-sequence state a recipe keeps, by kind.

    Attributes:
        num_kv_layers: layers that keep K and V in pages.
        num_kv_heads: KV heads per such layer.
        head_dim: channels per head.
        page_size: tokens per KV page.
        dtype: element type of the KV pool.
    """

    num_kv_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V for one token over all KV layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_kv_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one KV page (all KV layers, K and V)."""
        return self.kv_bytes_per_token * self.page_size


SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
}
RECIPE_VERSIONS = {"llama": 1}


def recipe_for(config: ModelConfig) -> str:
    """Name of the recipe that runs `config`.

    Raises:
        ValueError: the architecture has no recipe, naming it and the supported ones.
    """
    try:
        return SUPPORTED_ARCHITECTURES[config.architecture]
    except KeyError:
        raise ValueError(
            f"architecture {config.architecture!r} has no recipe; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        ) from None


def state_layout(config: ModelConfig, page_size: int, dtype: torch.dtype) -> StateLayout:
    """The state layout of a dense recipe: every layer keeps KV pages."""
    return StateLayout(
        num_kv_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        page_size=page_size,
        dtype=dtype,
    )
