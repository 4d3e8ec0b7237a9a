"""Recipe `lfm2`: Liquid's LFM2 (transformers' `Lfm2ForCausalLM`).

A hybrid decoder: most layers are gated short convolutions (`conv`: in_proj to B, C, x;
y = C * conv(B * x) with a causal depthwise kernel of `conv_L_cache` taps), the others
GQA attention with per-head q/k RMSNorm and full RoPE over the paged KV cache; every
layer ends in a SwiGLU MLP (`feed_forward.w1/w3/w2`). The final norm is named
`model.embedding_norm` in transformers.

Per sequence the state is: KV pages of the attention layers (`kv.k[j]` is the j-th
attention layer), plus one state slot (`StateSlotPool`) holding each conv layer's window
of the last L_cache-1 `B * x` inputs, at the position after the last token seen.

Exact by default: the projections are row-invariant `flare.models.quant.linear.Linear`s and the
conv takes its taps in one fixed order for decode and prefill (`causal_conv`), so a
token's result does not depend on chunking, reuse or the batch (see
`flare.models.hybrid_decoder`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flare.models.attention import AttentionBatch
from flare.models.hybrid_common import (causal_conv, decoder_tensor_names, eos_ids, hybrid_layout,
                                        layers_of, rms_norm, rope_theta)
from flare.models.hybrid_decoder import (AttentionWeights, HybridBlock, HybridDecoder, SwiGLU,
                                         linear)
from flare.models.quant.linear import Linear
from flare.state.layout import StateLayout
from flare.models.weights import tensor_getter
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
        return layers_of(self.layer_types, FULL)

    @property
    def conv_layers(self) -> tuple[int, ...]:
        return layers_of(self.layer_types, CONV)


def state_layout(config: Lfm2Config, page_size: int, dtype: torch.dtype) -> StateLayout:
    """KV pages for the attention layers; per conv layer a conv state
    [hidden, L_cache-1] of `dtype` (no recurrent state)."""
    c = config
    return hybrid_layout(c, page_size, dtype, kv_layers=c.attention_layers,
                         state_layers=c.conv_layers,
                         conv_shape=(c.hidden_size, c.conv_L_cache - 1))


def expected_tensor_names(config: Lfm2Config) -> set[str]:
    """Tensor names of an `Lfm2ForCausalLM` of `config`."""
    names = decoder_tensor_names(config, "model.embedding_norm.weight", (
        "operator_norm.weight", "ffn_norm.weight", "feed_forward.w1.weight",
        "feed_forward.w2.weight", "feed_forward.w3.weight"))
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}."
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
    in_proj: Linear  # [3 hidden, hidden]: B | C | x (bias optional)
    conv: torch.Tensor  # [hidden, L_cache]
    conv_bias: torch.Tensor | None
    out_proj: Linear  # [hidden, hidden] (bias optional)


class Lfm2Model(HybridDecoder):
    """The LFM2 decoder over a paged KV cache and a state-slot pool (the loop, attention,
    `forward` and `logits` are `HybridDecoder`'s; this adds the gated short convolution).

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

        embed = w("model.embed_tokens.weight")  # [V, hidden]
        kv_index = {layer: j for j, layer in enumerate(c.attention_layers)}
        blocks = []
        for i, kind in enumerate(c.layer_types):
            p = f"model.layers.{i}."
            mixer: _ShortConv | AttentionWeights
            if kind == CONV:
                a = p + "conv."
                mixer = _ShortConv(
                    in_proj=linear(w(a + "in_proj.weight"), opt(a + "in_proj.bias")),
                    conv=w(a + "conv.weight").squeeze(1), conv_bias=opt(a + "conv.bias"),
                    out_proj=linear(w(a + "out_proj.weight"), opt(a + "out_proj.bias")))
            else:
                a = p + "self_attn."
                mixer = AttentionWeights(
                    qkv=linear(torch.cat([w(a + f"{n}_proj.weight") for n in "qkv"])),
                    q_norm=w(a + "q_layernorm.weight"), k_norm=w(a + "k_layernorm.weight"),
                    o_proj=linear(w(a + "out_proj.weight")), kv_index=kv_index[i])
            f = p + "feed_forward."
            blocks.append(HybridBlock(
                index=i, input_norm=w(p + "operator_norm.weight"), mixer=mixer,
                post_norm=w(p + "ffn_norm.weight"),
                mlp=SwiGLU.of(w(f + "w1.weight"), w(f + "w3.weight"), w(f + "w2.weight"))))
        super().__init__(
            embed=embed, lm_head=embed if c.tie_word_embeddings else w("lm_head.weight"),
            final_norm=w("model.embedding_norm.weight"), blocks=blocks, norm=rms_norm,
            eps=c.norm_eps, num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rotary_dim=c.head_dim,
            rope_theta=c.rope_theta, max_positions=max_positions)

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor],
                max_positions: int) -> "Lfm2Model":
        """Build from a `config.json` dict and a folder's tensors."""
        return cls(Lfm2Config.from_hf(hf_config), tensors, max_positions)

    def _mix(self, y: torch.Tensor, m: _ShortConv, layer: int, batch: AttentionBatch,
             states: StateSlotPool) -> torch.Tensor:
        """Gated short conv: in_proj to B, C, x; C * conv(B * x) with the layer's conv
        state; out_proj. [T, hidden] -> [T, hidden]."""
        b, c, x = m.in_proj(y).chunk(3, dim=-1)  # [T, hidden] each
        conv = causal_conv(b * x, m.conv, m.conv_bias, batch, states.conv[layer])
        return m.out_proj(c * conv)
