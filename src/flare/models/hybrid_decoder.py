"""The decoder loop shared by the hybrid recipes (`qwen3_5`, `qwen3_next`, `lfm2`).

A hybrid model is a stack of pre-norm blocks: norm, a *mixer* (GQA attention over the paged
KV cache, or a recipe's own sequence mixer that keeps its per-sequence state in a state
slot), residual add, norm, SwiGLU MLP, residual add; then a final norm and the LM head.
`HybridDecoder` runs that loop and the attention layers; a recipe subclasses it, builds its
blocks from its checkpoint's names and implements `_mix` for its other layer type (Gated
DeltaNet for Qwen3.5, the gated short convolution for LFM2).

The attention covers both recipes' flavours: per-head q/k RMSNorm (the recipe's norm), RoPE
on the first `rotary_dim` channels of each head (all of them for LFM2, a quarter for
Qwen3.5), optional q/k/v/o biases and Qwen3.5's sigmoid output gate (`q_proj` yields a
query and a gate per head).

Exact by default: every linear layer is a `flare.models.quant.linear.Linear` built once at load
(its CPU float kernel gives a row the same result whatever rows are beside it), the
attention runs `paged_attention` with Flare's fused ops when serving float32 on CPU (one
fixed-order routine for decode and prefill), and norms, RoPE and activations are
row-invariant torch ops (`flare.models.hybrid_common`). So a token's logits are the same
bit for bit in one prefill, in chunks of any size, after reuse of a saved state, and alone
or batched beside other sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch

from flare.models.attention import AttentionBatch, paged_attention
from flare.models.hybrid_common import apply_rope, check_state_slots, rope_tables, sigmoid, silu
from flare.models.quant.linear import Linear
from flare.state.pools import KVCache
from flare.state.slots import StateSlotPool

# (x [..., C], weight [C], eps) -> normalized x, dtype of x: `rms_norm` or `rms_norm_offset`
NormFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A `flare.models.quant.linear.Linear` of a weight [out, in] (and bias [out]) in the serving
    dtype, which is the weight's own dtype for the hybrid recipes (weight format `full`)."""
    return Linear(weight, bias, weight.dtype)


def kernel_ops(dtype: torch.dtype, device: torch.device) -> tuple[ModuleType | None,
                                                                  ModuleType | None]:
    """The kernel module for (attention, recurrence): `flare.kernels.fused_ops()` for the
    attention when serving float32 on CPU, and for the gated delta rule on CPU in any
    serving dtype (it runs in float32); None where it cannot be had ($FLARE_FUSED_OPS=0,
    no AVX2/FMA, no compiler) or off the CPU, which selects the torch paths."""
    if device.type != "cpu":
        return None, None
    from flare.kernels import fused_ops

    ops = fused_ops()
    rec = ops if ops is not None and hasattr(ops, "gated_delta_rule") else None
    return (ops if dtype == torch.float32 else None), rec


@dataclass
class AttentionWeights:
    """One attention layer's weights, q/k/v fused.

    Attributes:
        qkv: weight [H*Dq + 2 KVH*D, hidden] (with its bias, if any), Dq = 2D when `gated`
            (per head: query | gate, as Qwen3.5's `q_proj` lays them out), else D; then
            k, then v.
        q_norm, k_norm: [D] per-head RMSNorm weights (applied with the model's norm).
        o_proj: weight [hidden, H*D] (with its bias, if any).
        kv_index: this layer's index into `kv.k` / `kv.v`.
        gated: the attention output is multiplied by sigmoid(gate) before `o_proj`.
    """

    qkv: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: Linear
    kv_index: int
    gated: bool = False


@dataclass
class SwiGLU:
    """A dense SwiGLU MLP: gate_up [2 I, hidden] (gate rows, then up rows), down
    [hidden, I], both in the serving dtype (`SwiGLU.of` builds it from the weights)."""

    gate_up: Linear
    down: Linear

    @classmethod
    def of(cls, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> "SwiGLU":
        """From gate_proj [I, hidden], up_proj [I, hidden] and down_proj [hidden, I]."""
        return cls(linear(torch.cat([gate, up])), linear(down))

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        """[T, hidden] normalized inputs -> [T, hidden], dtype of `y`."""
        gate, up = self.gate_up(y).chunk(2, dim=-1)  # [T, I] each
        return self.down(silu(gate) * up)


@dataclass
class HybridBlock:
    """One decoder layer: `mixer` is `AttentionWeights` or the recipe's own mixer weights
    (handed to `HybridDecoder._mix`); norms [hidden]; `mlp` maps the normalized [T, hidden]
    to [T, hidden] (`SwiGLU`, or a recipe's own, e.g. a sparse MoE)."""

    index: int
    input_norm: torch.Tensor
    mixer: Any
    post_norm: torch.Tensor
    mlp: Callable[[torch.Tensor], torch.Tensor]


class HybridDecoder:
    """Embedding, the block loop, attention over the paged KV cache, final norm and logits.

    Args:
        embed: [V, hidden] token embeddings (the serving dtype and device).
        lm_head: [V, hidden], `embed` itself when tied (run as a `Linear`).
        final_norm: [hidden].
        blocks: the decoder layers, in order.
        norm: the recipe's RMSNorm (`rms_norm` or `rms_norm_offset`), used for every norm
            of the loop and the attention's q/k norms.
        eps: its epsilon.
        num_heads, num_kv_heads, head_dim: attention geometry (D = head_dim).
        rotary_dim: RoPE channels per head (even, <= head_dim).
        rope_theta: RoPE base; max_positions: size of the RoPE tables.

    Attributes:
        ops: the kernel module passed to `paged_attention` (float32 on CPU), or None.
        recurrent_ops: the kernel module for a recipe's recurrence (CPU), or None.
        (Both from `kernel_ops`.)
    """

    def __init__(self, *, embed: torch.Tensor, lm_head: torch.Tensor,
                 final_norm: torch.Tensor, blocks: list[HybridBlock], norm: NormFn,
                 eps: float, num_heads: int, num_kv_heads: int, head_dim: int,
                 rotary_dim: int, rope_theta: float, max_positions: int) -> None:
        self.embed = embed
        self.lm_head = linear(lm_head)
        self.ops, self.recurrent_ops = kernel_ops(embed.dtype, embed.device)
        self.final_norm = final_norm
        self.blocks = blocks
        self.norm = norm
        self.eps = eps
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.cos, self.sin = rope_tables(rope_theta, rotary_dim, max_positions,
                                         embed.dtype, embed.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv: KVCache, states: StateSlotPool) -> torch.Tensor:
        """Run the decoder over the step's tokens.

        Args:
            input_ids: int64 [T], the step's new tokens (decode tokens first, then chunks).
            positions: int64 [T], each token's position in its sequence.
            batch: K/V slots and gathers, plus each group's state slot (`decode.state_slots`,
                `PrefillChunk.state_slot`), which must hold the state at the group's first
                position.
            kv: paged cache of the attention layers (`batch.slot_mapping` is written).
            states: the recipe's conv / recurrent states; the batch's slots are advanced in
                place to the position after each group's last token.

        Returns:
            Final hidden states [T, hidden] after the last norm, in the serving dtype.

        Raises:
            ValueError: a group of the batch has no state slot.
        """
        check_state_slots(batch)
        norm, eps = self.norm, self.eps
        x = self.embed[input_ids]  # [T, hidden]
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, R]
        sin = self.sin[positions].unsqueeze(1)
        for blk in self.blocks:
            y = norm(x, blk.input_norm, eps)
            if isinstance(blk.mixer, AttentionWeights):
                x = x + self._attention(y, blk.mixer, cos, sin, batch, kv)
            else:
                x = x + self._mix(y, blk.mixer, blk.index, batch, states)
            x = x + blk.mlp(norm(x, blk.post_norm, eps))
        return norm(x, self.final_norm, eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits, fp32 [N, vocab], from final hidden states [N, hidden]."""
        return self.lm_head(hidden).float()

    def _mix(self, y: torch.Tensor, mixer: Any, layer: int, batch: AttentionBatch,
             states: StateSlotPool) -> torch.Tensor:
        """The recipe's non-attention mixer of model layer `layer`: [T, hidden] normalized
        inputs to [T, hidden] outputs (before the residual add), advancing the batch's
        state slots of that layer. Subclasses implement it."""
        raise NotImplementedError

    def _attention(self, y: torch.Tensor, m: AttentionWeights, cos: torch.Tensor,
                   sin: torch.Tensor, batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        t = y.shape[0]
        qg, k, v = m.qkv(y).split(
            [h * d * (2 if m.gated else 1), kvh * d, kvh * d], dim=-1)
        if m.gated:
            q, gate = qg.view(t, h, 2 * d).split([d, d], dim=-1)  # [T, H, D] each
        else:
            q, gate = qg.view(t, h, d), None
        q = apply_rope(self.norm(q, m.q_norm, self.eps), cos, sin)
        k = apply_rope(self.norm(k.view(t, kvh, d), m.k_norm, self.eps), cos, sin)
        k_cache, v_cache = kv.k_layers[m.kv_index], kv.v_layers[m.kv_index]
        k_cache.index_copy_(0, batch.slot_mapping, k.to(k_cache.dtype))  # the pool's dtype
        v_cache.index_copy_(0, batch.slot_mapping, v.view(t, kvh, d).to(v_cache.dtype))
        o = paged_attention(q, k_cache, v_cache, batch, d ** -0.5, self.ops)
        o = o.reshape(t, h * d)
        if gate is not None:
            o = o * sigmoid(gate.reshape(t, h * d))
        return m.o_proj(o)
