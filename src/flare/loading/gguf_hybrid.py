"""Hybrid GGUF files: llama.cpp's `lfm2` and `qwen35` architectures, read into the names,
config and layout of Flare's `lfm2` and `qwen3_5` recipes (transformers' `Lfm2ForCausalLM`
and `Qwen3_5ForCausalLM`, as a safetensors folder of the same model has them).

The names and metadata keys follow llama.cpp's gguf-py (`constants.py` TENSOR_NAMES,
`tensor_mapping.py`, the `{arch}.ssm.*`, `{arch}.shortconv.*` keys). llama.cpp's converter
(`convert_hf_to_gguf.py`: `LFM2Model`, `Qwen3NextModel`, `_LinearAttentionVReorderBase`,
`Qwen3_5TextModel`) changes some tensors on the way; `undo_converter` reverses each:

- LFM2: the short conv kernel `conv.conv.weight` [C, 1, K] is stored squeezed, [C, K].
- Qwen3.5:
  1. zero-centred norms (`input_layernorm`, `post_attention_layernorm`, `model.norm`,
     `q_norm`, `k_norm`) are stored as `1 + w`; the gated `linear_attn.norm` is not;
  2. `A_log` is stored as `-exp(A_log)` (tensor `blk.N.ssm_a`);
  3. `conv1d.weight` [C, 1, K] is stored squeezed, [C, K];
  4. `dt_bias` is named `blk.N.ssm_dt.bias`;
  5. with fewer key heads than value heads, the value heads are reordered from grouped by
     key head (`k0v0 k0v1 k1v0 k1v1`) to tiled (`k0v0 k1v0 k0v1 k1v1`) in every tensor
     with a value-head axis: the V rows of `in_proj_qkv` and `conv1d`, the rows of
     `in_proj_z`, `in_proj_b`, `in_proj_a`, the entries of `A_log` and `dt_bias`, and the
     columns of `out_proj`.

Exactness of the undo, float32: the permutations and reshapes are exact; `w = s - 1` of a
stored norm scale `s` is exact for `s >= 0.5` (Sterbenz), so the recipe's `1 + w` is the
file's `s` bit for bit; `A_log` is the float32 whose `-exp` (torch, float32, as the recipe
computes the decay) equals the stored value where one exists, else the nearest one.

Tensor types: any `gguf` can dequantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, ...),
dequantized to float32 before the undo (`gguf.quants.dequantize`, exact). The hybrid
recipes run weight format `full`, so no block is served as stored (`hybrid_blocks` records
each 2-D weight's type only).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from flare.loading.gguf_names import GLOBAL_NAMES, TRANSFORMER_BLOCK_NAMES
from flare.models.config import ModelConfig
from flare.models.quant.gguf_blocks import GGUFBlocks
from flare.progress import progress_bar

# GGUF general.architecture -> transformers architecture (the recipe's key)
HYBRID_ARCHITECTURES = {"lfm2": "Lfm2ForCausalLM", "qwen35": "Qwen3_5ForCausalLM"}

# llama.cpp name (without the block prefix and the .weight / .bias suffix) -> HF module
_NAMES: dict[str, dict[str, dict[str, str]]] = {
    "lfm2": {
        "global": {"token_embd": "model.embed_tokens", "token_embd_norm": "model.embedding_norm",
                   "output": "lm_head"},
        "block": {
            "attn_norm": "operator_norm",
            "ffn_norm": "ffn_norm",
            "ffn_gate": "feed_forward.w1",
            "ffn_up": "feed_forward.w3",
            "ffn_down": "feed_forward.w2",
            "attn_q": "self_attn.q_proj",
            "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.out_proj",
            "attn_q_norm": "self_attn.q_layernorm",
            "attn_k_norm": "self_attn.k_layernorm",
            "shortconv.conv": "conv.conv",
            "shortconv.in_proj": "conv.in_proj",
            "shortconv.out_proj": "conv.out_proj",
        },
    },
    "qwen35": {
        "global": GLOBAL_NAMES,
        "block": {
            **TRANSFORMER_BLOCK_NAMES,
            "post_attention_norm": "post_attention_layernorm",
            "attn_qkv": "linear_attn.in_proj_qkv",
            "attn_gate": "linear_attn.in_proj_z",
            "ssm_beta": "linear_attn.in_proj_b",
            "ssm_alpha": "linear_attn.in_proj_a",
            "ssm_conv1d": "linear_attn.conv1d",
            "ssm_norm": "linear_attn.norm",
            "ssm_out": "linear_attn.out_proj",
        },
        # whole leaf names: A_log has no suffix, dt_bias is renamed to a bias
        "bare": {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"},
    },
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# Qwen3.5 norms llama.cpp stores as 1 + w (every `*norm.weight` but `linear_attn.norm`)
_OFFSET_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight",
                 "model.norm.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight")


def hybrid_tensor_name(arch: str, gguf_name: str) -> tuple[int | None, str] | None:
    """(block index or None, Hugging Face name) of a tensor of a hybrid GGUF
    ("blk.3.ssm_a" -> (3, "model.layers.3.linear_attn.A_log")); None when unknown."""
    names = _NAMES[arch]
    if m := _BLOCK.match(gguf_name):
        layer, rest = int(m.group(1)), m.group(2)
        p = f"model.layers.{layer}."
        if rest in names.get("bare", {}):
            return layer, p + names["bare"][rest]
        leaf, _, suffix = rest.rpartition(".")
        if suffix in ("weight", "bias") and leaf in names["block"]:
            return layer, f"{p}{names['block'][leaf]}.{suffix}"
        return None
    leaf, _, suffix = gguf_name.rpartition(".")
    if suffix in ("weight", "bias") and leaf in names["global"]:
        return None, f"{names['global'][leaf]}.{suffix}"
    return None


# ---- config ------------------------------------------------------------------------------

Field = Callable[..., Any]  # (key, default=None) -> the GGUF metadata value


def hybrid_hf_config(reader: GGUFReader, arch: str, field: Field,
                     where: str = "GGUF") -> dict[str, Any]:
    """A transformers `config.json` dict of a `lfm2` or `qwen35` GGUF, as the recipe reads it.

    Keys read (`{arch}.` prefixed): context_length, embedding_length, block_count,
    feed_forward_length, attention.head_count, attention.head_count_kv (LFM2: one per
    layer, 0 on conv layers), attention.key_length, attention.layer_norm_rms_epsilon,
    rope.freq_base; LFM2 shortconv.l_cache; Qwen3.5 full_attention_interval,
    rope.dimension_count (the rotary width), rope.dimension_sections, ssm.conv_kernel,
    ssm.state_size (key head dim), ssm.group_count (key heads), ssm.time_step_rank (value
    heads), ssm.inner_size (value heads x value head dim), nextn_predict_layers (an MTP
    block after the decoder, dropped as transformers drops it). Layer kinds come from the
    tensors present and must agree with the metadata. Vocabulary = rows of `token_embd`;
    tied = no `output.weight`; bos/eos/pad from `tokenizer.ggml.*`.

    Raises:
        ValueError: a required key missing, layer kinds the tensors and the metadata
            disagree on, or per-layer head counts the recipe cannot run (named).
    """

    def req(key: str) -> Any:
        value = field(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{where}: GGUF metadata lacks required key {arch}.{key}")
        return value

    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ValueError(f"{where}: GGUF has no token_embd.weight")
    hidden, heads = int(req("embedding_length")), int(req("attention.head_count"))
    cfg: dict[str, Any] = {
        "architectures": [HYBRID_ARCHITECTURES[arch]],
        "vocab_size": int(names["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_attention_heads": heads,
        "head_dim": int(field(f"{arch}.attention.key_length", hidden // heads)),
        "max_position_embeddings": int(req("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
    }
    n = int(req("block_count"))
    eps = float(req("attention.layer_norm_rms_epsilon"))
    theta = float(field(f"{arch}.rope.freq_base", 10000.0 if arch == "qwen35" else 1e6))
    kv = req("attention.head_count_kv")
    if arch == "lfm2":
        conv = [f"blk.{i}.shortconv.in_proj.weight" in names for i in range(n)]
        kv_list = kv if isinstance(kv, list) else [0 if c else int(kv) for c in conv]
        if len(kv_list) != n or any((h == 0) != c for h, c in zip(kv_list, conv)):
            raise ValueError(f"{where}: lfm2 attention.head_count_kv {kv_list} does not match "
                             f"the conv layers the tensors have {[i for i in range(n) if conv[i]]}")
        kv_heads = {int(h) for h in kv_list if h}
        if len(kv_heads) > 1:
            raise ValueError(f"{where}: attention layers with different KV head counts "
                             f"{sorted(kv_heads)} are not supported")
        cfg |= {
            "model_type": "lfm2",
            "num_hidden_layers": n,
            "layer_types": ["conv" if c else "full_attention" for c in conv],
            "num_key_value_heads": kv_heads.pop() if kv_heads else heads,
            "block_auto_adjust_ff_dim": False,  # the file's width is the final one
            "norm_eps": eps,
            "conv_L_cache": int(req("shortconv.l_cache")),
            "conv_bias": any(k.endswith("shortconv.in_proj.bias") for k in names),
            "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        }
    else:
        if isinstance(kv, list):
            raise ValueError(f"{where}: per-layer KV head counts are not supported")
        n -= int(field(f"{arch}.nextn_predict_layers", 0) or 0)
        every = int(field(f"{arch}.full_attention_interval", 4))
        linear = [f"blk.{i}.ssm_a" in names for i in range(n)]
        if linear != [(i + 1) % every != 0 for i in range(n)]:
            raise ValueError(f"{where}: the linear-attention layers the tensors have "
                             f"{[i for i in range(n) if linear[i]]} do not follow "
                             f"{arch}.full_attention_interval {every}")
        head_dim = cfg["head_dim"]
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta,
                                "partial_rotary_factor":
                                    int(req("rope.dimension_count")) / head_dim}
        sections = field(f"{arch}.rope.dimension_sections")
        if sections:  # text positions: the same on every axis, so it is plain RoPE
            rope |= {"mrope_section": [int(s) for s in sections if s], "mrope_interleaved": True}
        value_heads = int(req("ssm.time_step_rank"))
        first_full = next((i for i in range(n) if not linear[i]), None)
        cfg |= {
            "model_type": "qwen3_5_text",
            "num_hidden_layers": n,
            "layer_types": ["linear_attention" if x else "full_attention" for x in linear],
            "num_key_value_heads": int(kv),
            "rms_norm_eps": eps,
            "rope_parameters": rope,
            "attention_bias": first_full is not None
                              and f"blk.{first_full}.attn_q.bias" in names,
            "linear_conv_kernel_dim": int(req("ssm.conv_kernel")),
            "linear_key_head_dim": int(req("ssm.state_size")),
            "linear_num_key_heads": int(req("ssm.group_count")),
            "linear_num_value_heads": value_heads,
            "linear_value_head_dim": int(req("ssm.inner_size")) // value_heads,
        }
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        value = field(f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[hf_key] = int(value)
    return cfg


# ---- tensors -----------------------------------------------------------------------------

def tiled_to_grouped(t: torch.Tensor, dim: int, num_k_heads: int, v_per_k: int,
                     head_dim: int) -> torch.Tensor:
    """Undo llama.cpp's `_reorder_v_heads` along `dim`: value heads from tiled order
    (index r * Hk + k) back to grouped by key head (k * r_per_k + r), each head a block
    of `head_dim` entries. An exact permutation; same shape, contiguous."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], v_per_k, num_k_heads, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def a_log_of(stored: torch.Tensor) -> torch.Tensor:
    """`A_log` [Hv] float32 from llama.cpp's `-exp(A_log)` [Hv].

    Of the float32 values within 4 ulps of log(-stored) (computed in float64), each entry
    takes the one whose `-exp` in float32 (torch, on a [Hv] tensor, as the recipe computes
    its decay) is nearest to the stored value: equal to it wherever a float32 can be.
    """
    target = stored.float().contiguous()
    base = torch.log(-target.double()).float()
    best, best_err = base, (-base.exp() - target).abs()
    for toward in (float("inf"), float("-inf")):
        cand = base
        for _ in range(4):
            cand = torch.nextafter(cand, torch.full_like(cand, toward))
            err = (-cand.exp() - target).abs()
            better = err < best_err
            best, best_err = torch.where(better, cand, best), torch.where(better, err, best_err)
    return best


def undo_converter(arch: str, name: str, x: torch.Tensor, cfg: dict[str, Any]) -> torch.Tensor:
    """A tensor as the Hugging Face checkpoint has it, from its llama.cpp form (see the
    module docstring for each change).

    Args:
        arch: "lfm2" or "qwen35".
        name: its Hugging Face name (`hybrid_tensor_name`).
        x: float32, in the file's layout (row-major, GGUF's axes reversed).
        cfg: the `hybrid_hf_config` dict (head counts for the value-head reorder).
    Returns:
        float32, Hugging Face shape.
    """
    if arch == "lfm2":
        return x.unsqueeze(1) if name.endswith(".conv.conv.weight") else x
    if name.endswith(_OFFSET_NORMS):
        return x - 1.0
    if ".linear_attn." not in name:
        return x
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dv, r = cfg["linear_value_head_dim"], hv // hk
    qk = 2 * hk * cfg["linear_key_head_dim"]  # q and k rows before the value rows
    if name.endswith(".A_log"):  # reordered first: the fit runs in the recipe's order
        return a_log_of(tiled_to_grouped(x, 0, hk, r, 1))
    if name.endswith((".dt_bias", ".in_proj_a.weight", ".in_proj_b.weight")):
        return tiled_to_grouped(x, 0, hk, r, 1)
    if name.endswith(".in_proj_z.weight"):
        return tiled_to_grouped(x, 0, hk, r, dv)
    if name.endswith((".in_proj_qkv.weight", ".conv1d.weight")):
        x = torch.cat([x[:qk], tiled_to_grouped(x[qk:], 0, hk, r, dv)])
        return x.unsqueeze(1) if name.endswith(".conv1d.weight") else x
    if name.endswith(".out_proj.weight"):
        return tiled_to_grouped(x, 1, hk, r, dv)
    return x


def _named(reader: GGUFReader, arch: str, config: ModelConfig, where: str):
    """(tensor, HF name) of each tensor the recipe reads; the MTP block is skipped.

    Raises:
        ValueError: a tensor name with no Hugging Face equivalent (named).
    """
    n = config.num_hidden_layers
    for t in reader.tensors:
        got = hybrid_tensor_name(arch, t.name)
        if got is None:
            if (m := _BLOCK.match(t.name)) and int(m.group(1)) >= n:
                continue  # Qwen3.5's multi-token-prediction block, not part of the decoder
            raise ValueError(f"{where}: tensor {t.name!r} has no Hugging Face equivalent "
                             f"in the {arch} architecture")
        layer, name = got
        if layer is not None and layer >= n:
            continue
        yield t, name


def hybrid_tensors(reader: GGUFReader, config: ModelConfig, dtype: torch.dtype,
                   progress: bool = False, where: str = "GGUF") -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32, undo llama.cpp's converter (`undo_converter`),
    cast to `dtype`.

    Returns:
        HF name -> contiguous CPU tensor of `dtype` in HF shape.

    Raises:
        ValueError: a tensor name with no HF equivalent, or a type `gguf` cannot dequantize
            (named).
    """
    arch = _arch_of(config)
    cfg = config.hf or {}
    out: dict[str, torch.Tensor] = {}
    for t, name in progress_bar(list(_named(reader, arch, config, where)),
                                desc="dequantizing", unit="tensor", disable=not progress):
        kind = GGMLQuantizationType(t.tensor_type)
        try:
            arr = dequantize(t.data, kind)
        except NotImplementedError:
            raise ValueError(f"{where}: tensor {t.name!r} has type {kind.name}, which gguf "
                             f"cannot dequantize") from None
        x = torch.from_numpy(np.array(arr, dtype=np.float32))  # a copy: the map is read-only
        out[name] = undo_converter(arch, name, x, cfg).to(dtype).contiguous()
    return out


def hybrid_blocks(reader: GGUFReader, config: ModelConfig,
                  where: str = "GGUF") -> dict[str, GGUFBlocks]:
    """Each 2-D weight's GGUF type (HF names), without block bytes: the hybrid recipes run
    weight format `full`, so nothing is served as stored."""
    arch = _arch_of(config)
    return {name: GGUFBlocks(GGMLQuantizationType(t.tensor_type).name, None)
            for t, name in _named(reader, arch, config, where) if len(t.shape) == 2}


def _arch_of(config: ModelConfig) -> str:
    for arch, hf_arch in HYBRID_ARCHITECTURES.items():
        if config.architecture == hf_arch:
            return arch
    raise ValueError(f"{config.architecture!r} is not a hybrid GGUF architecture; "
                     f"supported: {sorted(HYBRID_ARCHITECTURES)}")
