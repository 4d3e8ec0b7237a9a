"""Pieces shared by the hybrid recipes (`qwen3_5`, `qwen3_next`, `lfm2`): RMSNorm flavours,
RoPE tables (full or partial), config-dict helpers, the state layout and tensor names every
such decoder has, row-invariant activations, and the causal depthwise convolution that
carries its last kernel-1 inputs from step to step in a state slot.

Every function works on the step's flat token list (see `AttentionBatch`): decode tokens
first, one per sequence, then each prefill chunk; per-sequence state is addressed by the
batch's `state_slots` (decode) and `state_slot` (each chunk).

Exact by default: each function computes a token's row with arithmetic that does not
depend on the other rows of the call nor on how many there are, so a token's result is
the same alone, in a prefill chunk of any length or beside other sequences. Norms reduce
over the last axis only (torch reduces each row in one fixed order whatever T); the conv
takes its K taps in a fixed order with elementwise products and sums; the activations
(`sigmoid`, `silu`, `softplus`) are written with `exact_math.exp` / `exact_math.log1p`
(numpy's routines on CPU, not MKL's: see `flare.models.exact_math`), which run one
vectorized routine on every element, and exactly rounded arithmetic, because torch's own
`torch.sigmoid`, `F.silu` and `F.softplus` compute the last elements of a buffer (and of
each thread's share) with a scalar routine whose results differ in the last bit, so a
row's values would depend on where it lies in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from flare.models import exact_math
from flare.models.attention import AttentionBatch
from flare.state.layout import LayerStateSpec, StateLayout


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-style RMSNorm: normalize in fp32, cast back, then scale (LFM2, gated norm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of Qwen3.5/Qwen3-Next: `x_hat * (1 + w)`, all in fp32, then cast
    (the weight is stored as an offset from 1, so a zero weight is the identity scale)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """Elementwise 1 / (1 + exp(-x)), row-invariant (see the module docstring).

    Args:
        x: any shape, floating dtype. Returns: same shape and dtype.
    """
    return exact_math.exp(-x).add_(1).reciprocal_()


def silu(x: torch.Tensor) -> torch.Tensor:
    """Elementwise x / (1 + exp(-x)), row-invariant (see the module docstring).

    Args:
        x: any shape, floating dtype. Returns: same shape and dtype.
    """
    return x / exact_math.exp(-x).add_(1)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """Elementwise log(1 + exp(x)), x itself above 20 (`F.softplus`'s default threshold),
    row-invariant (see the module docstring).

    Args:
        x: any shape, floating dtype. Returns: same shape and dtype.
    """
    return torch.where(x > 20, x, exact_math.log1p(exact_math.exp(x)))


def rope_tables(theta: float, rotary_dim: int, max_positions: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, rotary_dim] of default RoPE: the angles in fp32
    as transformers builds them (position * inv_freq, duplicated halves), their cos and
    sin rounded from float64 (`flare.models.exact_math`, not torch's: the same bits in every
    process)."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float()
                           / rotary_dim))
    cos, sin = exact_math.rope_cos_sin(inv, max_positions)  # [P, rotary_dim]
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first `cos.shape[-1]` channels of each head (`rotate_half` style); the
    rest pass through (partial RoPE).

    Args:
        x: [T, heads, D]; cos, sin: [T, 1, R] with R <= D, R even.
    """
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    rot = rot * cos + rotated * sin
    return torch.cat([rot, rest], dim=-1) if rest.shape[-1] else rot


def rope_theta(cfg: dict[str, Any], default: float) -> float:
    """`rope_theta` of a config dict: in `rope_parameters` (transformers 5) or top level.

    Raises:
        ValueError: a RoPE type other than "default" (named).
    """
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if kind != "default":
        raise ValueError(f"rope type {kind!r} is not supported by the hybrid recipes "
                         f"(default only)")
    return float(params.get("rope_theta", cfg.get("rope_theta", default)))


def eos_ids(cfg: dict[str, Any]) -> tuple[int, ...]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def layers_of(layer_types: Sequence[str], kind: str) -> tuple[int, ...]:
    """Indices (0-based, over all layers) of the layers of `kind` in `layer_types`."""
    return tuple(i for i, t in enumerate(layer_types) if t == kind)


def hybrid_layout(config: Any, page_size: int, dtype: torch.dtype, *,
                  kv_layers: tuple[int, ...], state_layers: tuple[int, ...],
                  conv_shape: tuple[int, ...],
                  recurrent_shape: tuple[int, ...] = ()) -> StateLayout:
    """KV pages (`config.num_key_value_heads` heads of `config.head_dim`, `dtype`) for the
    attention layers `kv_layers`; per layer of `state_layers` a conv state `conv_shape`
    of `dtype` and, where `recurrent_shape` is given, a float32 recurrent state of that
    shape (it accumulates)."""
    return StateLayout(
        num_kv_layers=len(kv_layers),
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        page_size=page_size,
        dtype=dtype,
        kv_layers=kv_layers,
        layer_states=tuple(
            LayerStateSpec(layer=i, conv_shape=conv_shape, conv_dtype=dtype,
                           recurrent_shape=recurrent_shape, recurrent_dtype=torch.float32)
            for i in state_layers),
    )


def decoder_tensor_names(config: Any, final_norm: str, layer_parts: Sequence[str]) -> set[str]:
    """The tensor names a hybrid decoder of `config` has whatever its layers mix: the token
    embedding, `final_norm`, the output layer unless tied, and per layer
    `model.layers.{i}.` + each of `layer_parts` (its norms and MLP)."""
    names = {"model.embed_tokens.weight", final_norm}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(len(config.layer_types)):
        names |= {f"model.layers.{i}.{part}" for part in layer_parts}
    return names


def check_state_slots(batch: AttentionBatch) -> None:
    """Raise ValueError if a group of the batch names no state slot (a hybrid recipe
    cannot run a sequence without its conv/recurrent state)."""
    if batch.decode is not None and batch.decode.state_slots is None:
        raise ValueError("hybrid recipe: the decode group has no state_slots")
    for chunk in batch.prefills:
        if chunk.state_slot < 0:
            raise ValueError(f"hybrid recipe: the prefill chunk at token {chunk.start} has "
                             f"no state_slot")


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                batch: AttentionBatch, states: torch.Tensor) -> torch.Tensor:
    """Causal depthwise conv1d over each sequence's tokens, continuing from (and updating)
    the conv state in its slot.

    The state of a slot holds the conv inputs of the kernel-1 tokens before the group's
    first token (zeros at position 0, which is transformers' left zero padding), so a
    prefill cut into chunks computes what one chunk would. Decode tokens and prefill
    chunks run the same arithmetic (`conv_taps`): per output, the K taps oldest first,
    each an elementwise product added to the running sum, then the bias; so an output is
    bit for bit the same however the sequence is chunked or batched.

    Args:
        x: [T, C] conv inputs of the step's tokens.
        weight: [C, K] depthwise kernel (transformers' `conv.weight` [C, 1, K] squeezed).
        bias: [C] or None.
        batch: the step's layout; decode tokens use `decode.state_slots`, chunks
            `state_slot`.
        states: [num_slots, C, K-1] this layer's conv states; the groups' slots are
            overwritten with the inputs of their last K-1 tokens.

    Returns:
        [T, C] conv outputs (no activation), dtype of `x`.
    """
    taps = weight.T  # [K, C]
    out = torch.empty_like(x)
    dec = batch.decode
    if dec is not None:
        b, slots = dec.num_seqs, dec.state_slots
        window = torch.cat([states[slots].transpose(1, 2), x[:b].unsqueeze(1)], dim=1)
        out[:b] = conv_taps(window, taps, bias)[:, 0]  # window [B, K, C]
        states.index_copy_(0, slots, window[:, 1:].transpose(1, 2))
    for chunk in batch.prefills:
        s, t, slot = chunk.start, chunk.length, chunk.state_slot
        window = torch.cat([states[slot].T, x[s:s + t]]).unsqueeze(0)  # [1, K-1+t, C]
        out[s:s + t] = conv_taps(window, taps, bias)[0]
        states[slot].copy_(window[0, t:].T)  # the last K-1 inputs
    return out


def conv_taps(window: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None
              ) -> torch.Tensor:
    """The causal depthwise conv of windows of inputs, each output from its K inputs in a
    fixed order: y_t = (((w_0 x_t + w_1 x_(t+1)) + ...) + w_(K-1) x_(t+K-1)) + bias, every
    product and sum an elementwise torch op (exactly rounded, whatever the shapes).

    Args:
        window: [G, K-1+L, C] for G groups: each group's K-1 earlier inputs, then its L
            new ones.
        taps: [K, C] the kernel, oldest tap first (`weight.T`).
        bias: [C] or None.

    Returns:
        [G, L, C] outputs, dtype of `window`.
    """
    k = taps.shape[0]
    n = window.shape[1] - (k - 1)
    acc = window[:, 0:n] * taps[0]
    for j in range(1, k):
        acc = acc + window[:, j:j + n] * taps[j]
    return acc if bias is None else acc + bias
