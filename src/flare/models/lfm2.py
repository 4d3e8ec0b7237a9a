"""Recipe `lfm2`: Liquid's LFM2 (transformers' `Lfm2ForCausalLM`).

A hybrid decoder: most layers are gated short convolutions (`conv`: in_proj to B, C, x;
y = C * conv(B * x) with a causal depthwise kernel of `conv_L_cache` taps), the others
GQA attention with per-head q/k RMSNorm and full RoPE over the paged KV cache; every
layer ends in a SwiGLU MLP (`feed_forward.w1/w3/w2`). The final norm is named
`model.embedding_norm` in transformers.

Per sequence the state is: KV pages of the attention layers (`kv.k[j]` is the j-th
attention layer), plus one state slot (`StateSlotPool`) holding each conv layer's window
of the last L_cache-1 `B * x` inputs, at the position after the last token seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from flare.models.attention import AttentionBatch, paged_attention
from flare.models.hybrid_common import (apply_rope, causal_conv, check_state_slots, eos_ids,
                                        rms_norm, rope_tables, rope_theta)
from flare.models.recipe import LayerStateSpec, StateLayout
from flare.models.weights import tensor_getter
from flare.state.pools import KVCache
from flare.state.slots import StateSlotPool

CONV, FULL = "conv", "full_attention"


@dataclass(frozen=True)
class Lfm2Config:
    """Hyper-parameters of LFM2, in transformers' naming (`norm_eps`, `conv_L_cache`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    ff_dim: int  # the MLP's width after transformers' `block_auto_adjust_ff_dim` rule
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    conv_bias: bool
    conv_L_cache: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Lfm2Config":
        """Read a `config.json` dict (transformers' or the original LFM2 release's keys:
        `block_ff_dim`, `tie_embedding`, `full_attn_idxs`).

        Raises:
            ValueError: a missing required field, bad layer types, or an unsupported RoPE
                type (named).
        """
        try:
            n = int(cfg["num_hidden_layers"])
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            types = cfg.get("layer_types")
            if types is None:
                full = cfg.get("full_attn_idxs")
                full = range(n) if full is None else full
                types = [FULL if i in full else CONV for i in range(n)]
            ff = cfg.get("intermediate_size", cfg.get("block_ff_dim"))
            if ff is None:
                raise KeyError("intermediate_size")
            ff = int(ff)
            if cfg.get("block_auto_adjust_ff_dim", True):
                ff = int(2 * ff / 3)
                mult = cfg.get("block_ffn_dim_multiplier", 1.0)
                if mult is not None:
                    of = int(cfg.get("block_multiple_of", 256))
                    ff = of * ((int(mult * ff) + of - 1) // of)
            c = cls(
                architecture=(cfg.get("architectures") or ["Lfm2ForCausalLM"])[0],
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                ff_dim=ff,
                num_hidden_layers=n,
                layer_types=tuple(types),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                norm_eps=float(cfg.get("norm_eps", 1e-5)),
                rope_theta=rope_theta(cfg, 1_000_000.0),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 128_000)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings",
                                                 cfg.get("tie_embedding", True))),
                conv_bias=bool(cfg.get("conv_bias", False)),
                conv_L_cache=int(cfg.get("conv_L_cache", 3)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids(cfg),
            )
        except KeyError as exc:
            raise ValueError(f"lfm2 config lacks required field {exc.args[0]!r}") from None
        if len(c.layer_types) != n or set(c.layer_types) - {CONV, FULL}:
            raise ValueError(f"lfm2: layer_types must be {n} of {CONV!r} / {FULL!r}, "
                             f"got {list(c.layer_types)}")
        return c

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def conv_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == CONV)


def state_layout(config: Lfm2Config, page_size: int, dtype: torch.dtype) -> StateLayout:
    """KV pages for the attention layers; per conv layer a conv state
    [hidden, L_cache-1] of `dtype` (no recurrent state)."""
    c = config
    return StateLayout(
        num_kv_layers=len(c.attention_layers),
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        page_size=page_size,
        dtype=dtype,
        kv_layers=c.attention_layers,
        layer_states=tuple(
            LayerStateSpec(layer=i, conv_shape=(c.hidden_size, c.conv_L_cache - 1),
                           conv_dtype=dtype)
            for i in c.conv_layers),
    )


def expected_tensor_names(config: Lfm2Config) -> set[str]:
    """Tensor names of an `Lfm2ForCausalLM` of `config`."""
    names = {"model.embed_tokens.weight", "model.embedding_norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}."
        names |= {p + "operator_norm.weight", p + "ffn_norm.weight"}
        names |= {f"{p}feed_forward.w{n}.weight" for n in (1, 2, 3)}
        if kind == CONV:
            names |= {p + "conv.conv.weight", p + "conv.in_proj.weight",
                      p + "conv.out_proj.weight"}
            if config.conv_bias:
                names |= {p + "conv.conv.bias", p + "conv.in_proj.bias",
                          p + "conv.out_proj.bias"}
        else:
            a = p + "self_attn."
            names |= {f"{a}{n}_proj.weight" for n in "qkv"}
            names |= {a + "out_proj.weight", a + "q_layernorm.weight", a + "k_layernorm.weight"}
    return names


@dataclass
class _ShortConv:
    in_proj: torch.Tensor  # [3 hidden, hidden]: B | C | x
    in_bias: torch.Tensor | None
    conv: torch.Tensor  # [hidden, L_cache]
    conv_bias: torch.Tensor | None
    out_proj: torch.Tensor  # [hidden, hidden]
    out_bias: torch.Tensor | None


@dataclass
class _Attention:
    qkv: torch.Tensor  # [(H + 2 KVH) * D, hidden]
    q_norm: torch.Tensor  # [D]
    k_norm: torch.Tensor  # [D]
    out_proj: torch.Tensor  # [hidden, H * D]
    kv_index: int  # this layer's index into kv.k / kv.v


@dataclass
class _Block:
    index: int
    operator_norm: torch.Tensor  # [hidden]
    mixer: _ShortConv | _Attention
    ffn_norm: torch.Tensor  # [hidden]
    w13: torch.Tensor  # [2 I, hidden]: w1 (gate) | w3 (up)
    w2: torch.Tensor  # [hidden, I]


class Lfm2Model:
    """The LFM2 decoder over a paged KV cache and a state-slot pool.

    Args:
        config: model hyper-parameters.
        tensors: transformers-named weights in the serving dtype, on the serving device.
        max_positions: size of the RoPE table (the plan's max sequence length).

    Raises:
        ValueError: a tensor is missing (named).
    """

    def __init__(self, config: Lfm2Config, tensors: dict[str, torch.Tensor],
                 max_positions: int) -> None:
        self.config = c = config

        w = tensor_getter(tensors)

        def opt(name: str) -> torch.Tensor | None:
            return w(name) if c.conv_bias else None

        self.embed = w("model.embed_tokens.weight")  # [V, hidden]
        self.final_norm = w("model.embedding_norm.weight")
        self.lm_head = self.embed if c.tie_word_embeddings else w("lm_head.weight")
        kv_index = {layer: j for j, layer in enumerate(c.attention_layers)}
        self.blocks: list[_Block] = []
        for i, kind in enumerate(c.layer_types):
            p = f"model.layers.{i}."
            mixer: _ShortConv | _Attention
            if kind == CONV:
                a = p + "conv."
                mixer = _ShortConv(
                    in_proj=w(a + "in_proj.weight"), in_bias=opt(a + "in_proj.bias"),
                    conv=w(a + "conv.weight").squeeze(1), conv_bias=opt(a + "conv.bias"),
                    out_proj=w(a + "out_proj.weight"), out_bias=opt(a + "out_proj.bias"))
            else:
                a = p + "self_attn."
                mixer = _Attention(
                    qkv=torch.cat([w(a + f"{n}_proj.weight") for n in "qkv"]),
                    q_norm=w(a + "q_layernorm.weight"), k_norm=w(a + "k_layernorm.weight"),
                    out_proj=w(a + "out_proj.weight"), kv_index=kv_index[i])
            f = p + "feed_forward."
            self.blocks.append(_Block(
                index=i, operator_norm=w(p + "operator_norm.weight"), mixer=mixer,
                ffn_norm=w(p + "ffn_norm.weight"),
                w13=torch.cat([w(f + "w1.weight"), w(f + "w3.weight")]), w2=w(f + "w2.weight")))
        self.cos, self.sin = rope_tables(c.rope_theta, c.head_dim, max_positions,
                                         self.embed.dtype, self.embed.device)

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor],
                max_positions: int) -> "Lfm2Model":
        """Build from a `config.json` dict and a folder's tensors."""
        return cls(Lfm2Config.from_hf(hf_config), tensors, max_positions)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
                kv: KVCache, states: StateSlotPool) -> torch.Tensor:
        """Run the decoder over the step's tokens.

        Args:
            input_ids: int64 [T], the step's new tokens (decode tokens first, then chunks).
            positions: int64 [T], each token's position in its sequence.
            batch: K/V slots and gathers, plus each group's state slot, which must hold
                the state at the group's first position.
            kv: paged cache of the attention layers (`batch.slot_mapping` is written).
            states: conv states; the batch's slots are advanced in place to the position
                after each group's last token.

        Returns:
            Final hidden states [T, hidden] after `embedding_norm`, in the serving dtype.

        Raises:
            ValueError: a group of the batch has no state slot.
        """
        check_state_slots(batch)
        x = self.embed[input_ids]  # [T, hidden]
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        eps = self.config.norm_eps
        for blk in self.blocks:
            y = rms_norm(x, blk.operator_norm, eps)
            if isinstance(blk.mixer, _ShortConv):
                x = x + self._short_conv(y, blk.mixer, blk.index, batch, states)
            else:
                x = x + self._attention(y, blk.mixer, cos, sin, batch, kv)
            gate, up = F.linear(rms_norm(x, blk.ffn_norm, eps), blk.w13).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, blk.w2)
        return rms_norm(x, self.final_norm, eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits, fp32 [N, vocab], from final hidden states [N, hidden]."""
        return F.linear(hidden, self.lm_head).float()

    def _short_conv(self, y: torch.Tensor, m: _ShortConv, layer: int, batch: AttentionBatch,
                    states: StateSlotPool) -> torch.Tensor:
        b, c, x = F.linear(y, m.in_proj, m.in_bias).chunk(3, dim=-1)  # [T, hidden] each
        conv = causal_conv(b * x, m.conv, m.conv_bias, batch, states.conv[layer])
        return F.linear(c * conv, m.out_proj, m.out_bias)

    def _attention(self, y: torch.Tensor, m: _Attention, cos: torch.Tensor, sin: torch.Tensor,
                   batch: AttentionBatch, kv: KVCache) -> torch.Tensor:
        c = self.config
        h, kvh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        t = y.shape[0]
        q, k, v = F.linear(y, m.qkv).split([h * d, kvh * d, kvh * d], dim=-1)
        q = apply_rope(rms_norm(q.view(t, h, d), m.q_norm, c.norm_eps), cos, sin)
        k = apply_rope(rms_norm(k.view(t, kvh, d), m.k_norm, c.norm_eps), cos, sin)
        kv.k[m.kv_index].index_copy_(0, batch.slot_mapping, k)
        kv.v[m.kv_index].index_copy_(0, batch.slot_mapping, v.reshape(t, kvh, d))
        o = paged_attention(q, kv.k[m.kv_index], kv.v[m.kv_index], batch, d ** -0.5)
        return F.linear(o.reshape(t, h * d), m.out_proj)
