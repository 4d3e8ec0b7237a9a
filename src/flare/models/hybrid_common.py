"""Pieces shared by the hybrid recipes (`qwen3_5`, `lfm2`): RMSNorm flavours, RoPE tables
(full or partial), config-dict helpers, and the causal depthwise convolution that carries
its last kernel-1 inputs from step to step in a state slot.

Every function works on the step's flat token list (see `AttentionBatch`): decode tokens
first, one per sequence, then each prefill chunk; per-sequence state is addressed by the
batch's `state_slots` (decode) and `state_slot` (each chunk).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from flare.models.attention import AttentionBatch


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


def rope_tables(theta: float, rotary_dim: int, max_positions: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, rotary_dim] of default RoPE, built in fp32 the
    way transformers builds them (angles = position * inv_freq, duplicated halves)."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float()
                           / rotary_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, rotary_dim]
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)


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
    prefill cut into chunks computes what one chunk would.

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
    c, k = weight.shape
    out = torch.empty_like(x)
    dec = batch.decode
    if dec is not None:
        b, slots = dec.num_seqs, dec.state_slots
        window = torch.cat([states[slots], x[:b].unsqueeze(-1)], dim=-1)  # [B, C, K]
        y = (window * weight).sum(-1)  # [B, C]
        out[:b] = y if bias is None else y + bias
        states.index_copy_(0, slots, window[..., 1:])
    for chunk in batch.prefills:
        s, t, slot = chunk.start, chunk.length, chunk.state_slot
        window = torch.cat([states[slot], x[s:s + t].T], dim=-1)  # [C, K-1+t]
        y = F.conv1d(window.unsqueeze(0), weight.unsqueeze(1), bias, groups=c)  # [1, C, t]
        out[s:s + t] = y[0].T
        states[slot].copy_(window[:, window.shape[1] - (k - 1):])
    return out
