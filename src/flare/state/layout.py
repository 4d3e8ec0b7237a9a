"""What per-sequence state a recipe keeps: the shapes the pools are allocated from.

A recipe declares its `StateLayout` (`flare.models.recipe.model_state_layout`); planning,
pools, slots and reuse read it, so KV-only and hybrid models go through the same code.
It lives with the state it describes, so `flare.state` never imports `flare.models`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class LayerStateSpec:
    """The fixed-size, per-sequence state of one hybrid layer (one *state slot*'s share).

    Shapes exclude the slot axis: a `StateSlotPool` holds `[num_slots, *conv_shape]` and
    `[num_slots, *recurrent_shape]` for the layer. An empty shape means "none of this kind".

    Attributes:
        layer: index of the layer in the model (0-based, over all layers).
        conv_shape: causal-conv window, `(channels, kernel - 1)`: the inputs of the last
            kernel-1 tokens, channels first (the layout of causal-conv1d kernels).
        conv_dtype: element type of the conv state (the serving dtype).
        recurrent_shape: e.g. `(num_v_heads, head_k_dim, head_v_dim)` for Gated DeltaNet.
        recurrent_dtype: element type of the recurrent state (float32: it accumulates).
    """

    layer: int
    conv_shape: tuple[int, ...] = ()
    conv_dtype: torch.dtype = torch.float32
    recurrent_shape: tuple[int, ...] = ()
    recurrent_dtype: torch.dtype = torch.float32

    @property
    def bytes_per_slot(self) -> int:
        """Bytes this layer adds to one state slot."""
        n = 0
        if self.conv_shape:
            n += math.prod(self.conv_shape) * _elem_bytes(self.conv_dtype)
        if self.recurrent_shape:
            n += math.prod(self.recurrent_shape) * _elem_bytes(self.recurrent_dtype)
        return n


@dataclass(frozen=True)
class StateLayout:
    """Per-sequence state a recipe keeps, by kind.

    Attributes:
        num_kv_layers: layers that keep K and V in pages.
        num_kv_heads: KV heads per such layer.
        head_dim: channels per head.
        page_size: tokens per KV page.
        dtype: element type of the KV pool.
        kv_layers: model layer index of each KV layer, in KV-cache order (`kv.k[j]` belongs
            to layer `kv_layers[j]`); empty for dense recipes, where it is `0..n-1`.
        layer_states: conv / recurrent state of each hybrid layer, in layer order; empty
            for KV-only recipes. A sequence of a hybrid recipe holds one state slot.
    """

    num_kv_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype
    kv_layers: tuple[int, ...] = ()
    layer_states: tuple[LayerStateSpec, ...] = ()

    @property
    def is_hybrid(self) -> bool:
        """True when sequences also hold a state slot (conv and/or recurrent states)."""
        return bool(self.layer_states)

    @property
    def state_bytes_per_slot(self) -> int:
        """Bytes of one state slot: all layers' conv and recurrent states (0 if KV-only)."""
        return sum(s.bytes_per_slot for s in self.layer_states)

    def describe(self) -> dict[str, Any]:
        """The layout as a JSON-able dict (for the manifest: a package whose layout differs
        from the runtime's recipe must be refused, and this is what to compare)."""
        def dt(d: torch.dtype) -> str:
            return str(d).removeprefix("torch.")
        return {
            "num_kv_layers": self.num_kv_layers, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "page_size": self.page_size, "dtype": dt(self.dtype),
            "kv_layers": list(self.kv_layers or range(self.num_kv_layers)),
            "layer_states": [
                {"layer": s.layer, "conv_shape": list(s.conv_shape),
                 "conv_dtype": dt(s.conv_dtype), "recurrent_shape": list(s.recurrent_shape),
                 "recurrent_dtype": dt(s.recurrent_dtype)}
                for s in self.layer_states],
            "state_bytes_per_slot": self.state_bytes_per_slot,
        }

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K plus V for one token over all KV layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_kv_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one KV page (all KV layers, K and V)."""
        return self.kv_bytes_per_token * self.page_size
