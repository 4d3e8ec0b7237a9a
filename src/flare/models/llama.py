"""Recipe `llama`: Llama, SmolLM2, Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm).

The math follows transformers' `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM`
(pre-norm blocks, RoPE with `rotate_half`, GQA, SwiGLU MLP), so greedy tokens match theirs.
Weights arrive in Hugging Face naming; q/k/v and gate/up are fused once at load so a layer
is four matmuls. The forward is a plain function of the step's flat token list over a paged
KV cache: x is [T, hidden] for all T tokens of the step, whatever sequence they belong to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flare.models.attention import AttentionBatch, paged_attention
from flare.models.config import ModelConfig
from flare.models.weights import tensor_getter
from flare.state.pools import KVCache


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(H + 2 KVH) * D, hidden]
    qkv_bias: torch.Tensor | None  # [(H + 2 KVH) * D]
    q_norm: torch.Tensor | None  # [D] (Qwen3)
    k_norm: torch.Tensor | None  # [D]
    o_proj: torch.Tensor  # [hidden, H * D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [D/2] (fp32) for the config's RoPE, with its scaling.

    Follows transformers' `ROPE_INIT_FUNCTIONS` for "default", "linear" and "llama3".

    Raises:
        ValueError: an unsupported `rope_scaling` type, naming it.
    """
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


class LlamaModel:
    """The dense decoder of recipe `llama`, over a paged KV cache.

    Args:
        config: model hyper-parameters.
        tensors: Hugging Face-named weights (`model.layers.N.self_attn.q_proj.weight`, ...),
            already in the serving dtype and on the serving device.
        max_positions: size of the RoPE table (the plan's max sequence length).
    """

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor],
                 max_positions: int) -> None:
        self.config = config
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.scale = 1.0 / math.sqrt(c.head_dim)

        w = tensor_getter(tensors)

        self.embed = w("model.embed_tokens.weight")  # [V, hidden]
        self.final_norm = w("model.norm.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else w("lm_head.weight")
        self.layers: list[_Layer] = []
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if c.attention_bias:
                bias = torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"),
                                  w(a + "v_proj.bias")])
            self.layers.append(_Layer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"),
                               w(a + "v_proj.weight")]),
                qkv_bias=bias,
                q_norm=w(a + "q_norm.weight") if c.qk_norm else None,
                k_norm=w(a + "k_norm.weight") if c.qk_norm else None,
                o_proj=w(a + "o_proj.weight"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                down=w(p + "mlp.down_proj.weight"),
            ))
        dtype, device = self.embed.dtype, self.embed.device
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(c))
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D], as transformers builds it
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # transformers' LlamaRMSNorm: normalize in fp32, scale in the model dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, D]; cos/sin: [T, 1, D]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        """Run the decoder over the step's tokens, writing their K/V into `kv`.

        Args:
            input_ids: int64 [T], the step's new tokens (decode tokens first, then chunks).
            positions: int64 [T], each token's position in its sequence.
            batch: where to write and read K/V (see `AttentionBatch`).
            kv: the paged cache; slots in `batch.slot_mapping` are overwritten.

        Returns:
            Final hidden states [T, hidden] after the last norm, in the serving dtype.
        """
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        t = input_ids.shape[0]
        x = self.embed[input_ids]  # [T, hidden]
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        slots = batch.slot_mapping
        for i, layer in enumerate(self.layers):
            y = self._norm(x, layer.input_norm)
            qkv = F.linear(y, layer.qkv, layer.qkv_bias)  # [T, (H + 2 KVH) * D]
            q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
            q = q.view(t, h, d)
            k = k.view(t, kvh, d)
            v = v.view(t, kvh, d)
            if layer.q_norm is not None:
                q = self._norm(q, layer.q_norm)
                k = self._norm(k, layer.k_norm)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            kv.k[i].index_copy_(0, slots, k)
            kv.v[i].index_copy_(0, slots, v)
            o = paged_attention(q, kv.k[i], kv.v[i], batch, self.scale)  # [T, H, D]
            x = x + F.linear(o.reshape(t, h * d), layer.o_proj)
            y = self._norm(x, layer.post_norm)
            gate, up = F.linear(y, layer.gate_up).chunk(2, dim=-1)  # [T, I] each
            x = x + F.linear(F.silu(gate) * up, layer.down)
        return self._norm(x, self.final_norm)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits, fp32 [N, vocab], from final hidden states [N, hidden]."""
        return F.linear(hidden, self.lm_head).float()
