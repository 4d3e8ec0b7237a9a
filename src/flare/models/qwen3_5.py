"""Recipe `qwen3_5`: the text model of Qwen3.5 (transformers' `Qwen3_5ForCausalLM`).

A hybrid decoder: most layers are Gated DeltaNet (`linear_attention`: a causal depthwise
conv over the q/k/v mix, then a per-head gated delta rule with a recurrent state
[Hv, Dk, Dv]), every few layers one `full_attention` layer (gated output, partial RoPE,
zero-centred q/k RMSNorm) over the paged KV cache; every layer ends in a dense SwiGLU MLP.

Per sequence the state is: KV pages of the full-attention layers (`kv.k[j]` is the j-th
full-attention layer), plus one state slot (`StateSlotPool`) holding each DeltaNet layer's
conv window (the last kernel-1 q/k/v inputs) and recurrent state, both at the position
after the last token the forward has seen. Prefill chunks continue from their slot and
decode tokens take one step of the same token-by-token gated delta rule
(`flare.models.gated_delta`: recurrent.cpp's kernel, or a torch token loop without it), so a
token's output is bit for bit the same whether its sequence is prefilled at once, in
chunks of any size, token by token or beside other sequences (with the row-invariant
linear layers, attention and activations of `flare.models.hybrid_decoder`). Measured on the
2-core AVX2 machine, one thread, a random Qwen3.5 of the embedded model's geometry (30
layers, 23 DeltaNet), 512-token prefill through the model: 154 tok/s with the former
chunked (triangular-solve) prefill and F.linear, 286 tok/s with the kernel and the dense
Linear kernels (chunks of 64: 119 -> 244; decode at batch 1: 9.1 -> 22.3 tok/s; the tiny
test model: 12.9k -> 39.6k tok/s). Shared machine: compare the columns, not the figures. Weight names are
transformers' (`model.layers.N.linear_attn.in_proj_qkv.weight`, ...), so a saved
`Qwen3_5ForCausalLM` folder loads as is; a Qwen3.5 hub folder (`...ForConditionalGeneration`,
`model.language_model.*`) loads through `text_model_tensors`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from flare.models import exact_math
from flare.models.attention import AttentionBatch
from flare.models.gated_delta import gated_delta_rule, l2norm, step_runs
from flare.models.hybrid_common import (causal_conv, decoder_tensor_names, eos_ids,
                                        hybrid_layout, layers_of, rms_norm, rms_norm_offset,
                                        rope_theta, sigmoid, silu, softplus)
from flare.models.hybrid_decoder import (AttentionWeights, HybridBlock, HybridDecoder, SwiGLU,
                                         linear)
from flare.models.quant.linear import Linear
from flare.state.layout import StateLayout
from flare.models.weights import tensor_getter
from flare.state.slots import StateSlotPool

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class Qwen3_5Config:
    """Hyper-parameters of the Qwen3.5 text model, in transformers' naming.

    A relative's config (`qwen3_next`) subclasses it with fields of its own (with
    defaults), sets `RECIPE` / `DEFAULT_ARCHITECTURE` and reads them in `_extra_from_hf`.
    """

    RECIPE: ClassVar[str] = "qwen3_5"  # named in errors
    DEFAULT_ARCHITECTURE: ClassVar[str] = "Qwen3_5ForCausalLM"

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "Qwen3_5Config":
        """Read a `config.json` dict: flat (`Qwen3_5ForCausalLM`, model_type "qwen3_5_text")
        or nested under `text_config` (`Qwen3_5ForConditionalGeneration`).

        Raises:
            ValueError: a missing required field, an unsupported activation, RoPE type or
                layer type, or head counts that do not divide (named).
        """
        text = cfg.get("text_config") or cfg
        arch = (cfg.get("architectures") or [cls.DEFAULT_ARCHITECTURE])[0]
        name = cls.RECIPE
        try:
            n = int(text["num_hidden_layers"])
            hidden = int(text["hidden_size"])
            heads = int(text["num_attention_heads"])
            types = text.get("layer_types")
            if types is None:  # transformers' default: every 4th layer is full attention
                every = int(text.get("full_attention_interval", 4))
                types = [LINEAR if (i + 1) % every else FULL for i in range(n)]
            params = text.get("rope_parameters") or {}
            tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            c = cls(
                architecture=arch,
                vocab_size=int(text["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(text["intermediate_size"]),
                num_hidden_layers=n,
                layer_types=tuple(types),
                num_attention_heads=heads,
                num_key_value_heads=int(text.get("num_key_value_heads") or heads),
                head_dim=int(text.get("head_dim") or hidden // heads),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta(text, 10000.0),
                partial_rotary_factor=float(params.get(
                    "partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
                max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(tie),
                attention_bias=bool(text.get("attention_bias", False)),
                linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
                linear_key_head_dim=int(text["linear_key_head_dim"]),
                linear_value_head_dim=int(text["linear_value_head_dim"]),
                linear_num_key_heads=int(text["linear_num_key_heads"]),
                linear_num_value_heads=int(text["linear_num_value_heads"]),
                bos_token_id=text.get("bos_token_id", cfg.get("bos_token_id")),
                eos_token_ids=eos_ids(text) or eos_ids(cfg),
                **cls._extra_from_hf(text),
            )
        except KeyError as exc:
            raise ValueError(f"{name} config lacks required field {exc.args[0]!r}") from None
        act = text.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{name}: hidden_act {act!r} is not supported (silu)")
        if len(c.layer_types) != n or set(c.layer_types) - {LINEAR, FULL}:
            raise ValueError(f"{name}: layer_types must be {n} of {LINEAR!r} / {FULL!r}, "
                             f"got {list(c.layer_types)}")
        if c.linear_num_value_heads % c.linear_num_key_heads or heads % c.num_key_value_heads:
            raise ValueError(f"{name}: value heads must be a multiple of key heads")
        return c

    @classmethod
    def _extra_from_hf(cls, text: dict[str, Any]) -> dict[str, Any]:
        """A subclass's own fields, read from the (text) config dict; none here.

        Raises:
            KeyError: a required field is missing (reported as ValueError by `from_hf`).
        """
        return {}

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        """Channels of the DeltaNet conv: q, k and v together."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return layers_of(self.layer_types, FULL)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return layers_of(self.layer_types, LINEAR)


def state_layout(config: Qwen3_5Config, page_size: int, dtype: torch.dtype) -> StateLayout:
    """KV pages for the full-attention layers; per DeltaNet layer a conv state
    [conv_dim, kernel-1] of `dtype` and a float32 recurrent state [Hv, Dk, Dv]."""
    c = config
    return hybrid_layout(
        c, page_size, dtype, kv_layers=c.full_attention_layers,
        state_layers=c.linear_attention_layers,
        conv_shape=(c.conv_dim, c.linear_conv_kernel_dim - 1),
        recurrent_shape=(c.linear_num_value_heads, c.linear_key_head_dim,
                         c.linear_value_head_dim))


def expected_tensor_names(config: Qwen3_5Config) -> set[str]:
    """Tensor names of a `Qwen3_5ForCausalLM` of `config` (after `text_model_tensors`)."""
    names = decoder_tensor_names(config, "model.norm.weight", (
        "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight"))
    for i, kind in enumerate(config.layer_types):
        p = f"model.layers.{i}."
        if kind == LINEAR:
            a = p + "linear_attn."
            names |= {a + n for n in ("A_log", "dt_bias", "conv1d.weight", "norm.weight",
                                      "in_proj_qkv.weight", "in_proj_z.weight",
                                      "in_proj_b.weight", "in_proj_a.weight",
                                      "out_proj.weight")}
        else:
            a = p + "self_attn."
            names |= {f"{a}{n}_proj.weight" for n in "qkvo"}
            names |= {a + "q_norm.weight", a + "k_norm.weight"}
            if config.attention_bias:
                names |= {f"{a}{n}_proj.bias" for n in "qkvo"}
    return names


def text_model_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors of a Qwen3.5 folder in `Qwen3_5ForCausalLM` naming: a multimodal
    checkpoint's `model.language_model.*` becomes `model.*`; the vision tower
    (`model.visual.*`) and the multi-token-prediction head (`mtp.*`) are dropped, as
    transformers drops them when it loads the text model."""
    out = {}
    for name, t in tensors.items():
        if name.startswith(("model.visual.", "mtp.")):
            continue
        out[name.replace("model.language_model.", "model.", 1)] = t
    return out


# ---- the model --------------------------------------------------------------------------

@dataclass
class DeltaNetWeights:
    """One Gated DeltaNet layer's weights (serving dtype unless noted)."""

    in_proj: Linear  # [conv_dim + Hv*Dv + 2 Hv, hidden]: qkv | z | b | a
    conv: torch.Tensor  # [conv_dim, K]
    neg_a: torch.Tensor  # [Hv] float32, -exp(A_log)
    dt_bias: torch.Tensor  # [Hv] float32
    norm: torch.Tensor  # [Dv]
    out_proj: Linear  # [hidden, Hv*Dv]


def load_delta_net(w: Callable[[str], torch.Tensor], prefix: str,
                   in_proj: torch.Tensor | None = None) -> DeltaNetWeights:
    """A Gated DeltaNet layer's weights from Qwen3.5's names under `prefix`
    (`model.layers.N.linear_attn.`); `w` reads a tensor by name (ValueError if missing).
    `in_proj` [conv_dim + Hv*Dv + 2 Hv, hidden] (rows q | k | v | z | b | a), when given,
    replaces Qwen3.5's four input projections (a relative that lays them out otherwise)."""
    if in_proj is None:
        in_proj = torch.cat([w(prefix + "in_proj_qkv.weight"), w(prefix + "in_proj_z.weight"),
                             w(prefix + "in_proj_b.weight"), w(prefix + "in_proj_a.weight")])
    return DeltaNetWeights(
        in_proj=linear(in_proj),
        conv=w(prefix + "conv1d.weight").squeeze(1),
        neg_a=-exact_math.exp(w(prefix + "A_log").float()),
        dt_bias=w(prefix + "dt_bias").float(),
        norm=w(prefix + "norm.weight"),
        out_proj=linear(w(prefix + "out_proj.weight")))


def load_gated_attention(w: Callable[[str], torch.Tensor], prefix: str, bias: bool,
                         kv_index: int) -> AttentionWeights:
    """A gated full-attention layer's weights from Qwen3.5's names under `prefix`
    (`model.layers.N.self_attn.`; q_proj yields query and gate per head)."""
    return AttentionWeights(
        qkv=linear(torch.cat([w(prefix + f"{n}_proj.weight") for n in "qkv"]),
                   torch.cat([w(prefix + f"{n}_proj.bias") for n in "qkv"]) if bias else None),
        q_norm=w(prefix + "q_norm.weight"), k_norm=w(prefix + "k_norm.weight"),
        o_proj=linear(w(prefix + "o_proj.weight"), w(prefix + "o_proj.bias") if bias else None),
        kv_index=kv_index, gated=True)


class Qwen3_5Model(HybridDecoder):
    """The Qwen3.5 text decoder over a paged KV cache and a state-slot pool (the loop,
    attention, `forward` and `logits` are `HybridDecoder`'s; this adds Gated DeltaNet).

    Subclasses for relatives (`qwen3_next`) override `_load_delta_net` / `_load_mlp`
    (other checkpoint layouts, other MLPs) and `CONFIG`.

    Args:
        config: model hyper-parameters.
        tensors: `Qwen3_5ForCausalLM`-named weights (see `text_model_tensors`), in the
            serving dtype, on the serving device.
        max_positions: size of the RoPE table (the plan's max sequence length).

    Raises:
        ValueError: a tensor is missing (named).
    """

    CONFIG: type[Qwen3_5Config] = Qwen3_5Config

    def __init__(self, config: Qwen3_5Config, tensors: dict[str, torch.Tensor],
                 max_positions: int) -> None:
        self.config = c = config
        w = tensor_getter(tensors)
        embed = w("model.embed_tokens.weight")  # [V, hidden]
        kv_index = {layer: j for j, layer in enumerate(c.full_attention_layers)}
        blocks = []
        for i, kind in enumerate(c.layer_types):
            p = f"model.layers.{i}."
            mixer: DeltaNetWeights | AttentionWeights
            if kind == LINEAR:
                mixer = self._load_delta_net(w, p + "linear_attn.")
            else:
                mixer = load_gated_attention(w, p + "self_attn.", c.attention_bias,
                                             kv_index[i])
            blocks.append(HybridBlock(
                index=i, input_norm=w(p + "input_layernorm.weight"), mixer=mixer,
                post_norm=w(p + "post_attention_layernorm.weight"),
                mlp=self._load_mlp(w, p + "mlp.", i)))
        super().__init__(
            embed=embed, lm_head=embed if c.tie_word_embeddings else w("lm_head.weight"),
            final_norm=w("model.norm.weight"), blocks=blocks, norm=rms_norm_offset,
            eps=c.rms_norm_eps, num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
            rotary_dim=c.rotary_dim, rope_theta=c.rope_theta, max_positions=max_positions)

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor],
                max_positions: int) -> "Qwen3_5Model":
        """Build from a `config.json` dict and a folder's tensors (either naming)."""
        return cls(cls.CONFIG.from_hf(hf_config), text_model_tensors(tensors), max_positions)

    def _load_delta_net(self, w: Callable[[str], torch.Tensor], prefix: str) -> DeltaNetWeights:
        """A DeltaNet layer's weights under `prefix` (`model.layers.N.linear_attn.`)."""
        return load_delta_net(w, prefix)

    def _load_mlp(self, w: Callable[[str], torch.Tensor], prefix: str,
                  layer: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """Model layer `layer`'s MLP under `prefix` (`model.layers.N.mlp.`): dense SwiGLU."""
        return SwiGLU.of(w(prefix + "gate_proj.weight"), w(prefix + "up_proj.weight"),
                         w(prefix + "down_proj.weight"))

    def _mix(self, y: torch.Tensor, m: DeltaNetWeights, layer: int, batch: AttentionBatch,
             states: StateSlotPool) -> torch.Tensor:
        """Gated DeltaNet of model layer `layer`: [T, hidden] -> [T, hidden], advancing
        the batch's conv and recurrent states of that layer."""
        c = self.config
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        t = y.shape[0]
        mixed, z, b, a = m.in_proj(y).split([c.conv_dim, hv * dv, hv, hv], dim=-1)
        mixed = silu(causal_conv(mixed, m.conv, None, batch, states.conv[layer]))
        q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = l2norm(q.reshape(t, hk, dk).float()) * dk ** -0.5  # [T, Hk, Dk]
        k = l2norm(k.reshape(t, hk, dk).float())
        v = v.reshape(t, hv, dv).float()
        beta = sigmoid(b.float())  # [T, Hv]
        g = m.neg_a * softplus(a.float() + m.dt_bias)  # [T, Hv] log decay, <= 0
        starts, slots = step_runs(batch)
        o = gated_delta_rule(q, k, v, g, beta, states.recurrent[layer], starts, slots,
                             self.recurrent_ops)  # [T, Hv, Dv]
        # gated RMSNorm per value head: norm (weight in the serving dtype), then silu(z)
        o = rms_norm(o.to(y.dtype), m.norm, c.rms_norm_eps) * silu(z.reshape(t, hv, dv).float())
        return m.out_proj(o.to(y.dtype).reshape(t, hv * dv))
