"""Read a GGUF file (llama.cpp's format) into Hugging Face names, config and tokenizer.

Tensors are dequantized with `gguf.quants.dequantize` (the function transformers' own GGUF
loader uses), so the result equals `AutoModelForCausalLM.from_pretrained(folder,
gguf_file=...)` bit for bit. Supported: llama, qwen2, qwen3 architectures; any tensor type
`gguf` can dequantize (F32, F16, BF16, Q4_0, Q4_1, Q5_x, Q8_0, K-quants, ...).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from flare.loading.source import Checkpoint, check_tensor_names, source_identity
from flare.loading.gguf_hybrid import (HYBRID_ARCHITECTURES, hybrid_blocks, hybrid_hf_config,
                                       hybrid_tensors)
from flare.loading.gguf_names import GLOBAL_NAMES, TRANSFORMER_BLOCK_NAMES
from flare.loading.tokenizer import load_tokenizer
from flare.models.config import ModelConfig
from flare.models.quant.gguf_blocks import GGUFBlocks, GGUF_BLOCK_BYTES, GGUF_BLOCK_VALUES
from flare.models.recipe import recipe_for
from flare.progress import progress_bar

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}

_BLOCK_NAMES = {**TRANSFORMER_BLOCK_NAMES, "ffn_norm": "post_attention_layernorm"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL = re.compile(r"^(\w+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor name ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"); None when unknown."""
    if m := _BLOCK.match(gguf_name):
        layer, kind, suffix = m.groups()
        if kind in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[kind]}.{suffix}"
        return None
    if (m := _GLOBAL.match(gguf_name)) and m.group(1) in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def unpermute_qk(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of a Llama q_proj / k_proj weight or bias.

    convert_hf_to_gguf reorders each head's rows from HF's rotate-half RoPE layout
    (first half, second half) to interleaved pairs: `w.reshape(n_head, 2, d/2, ...)
    .swapaxes(1, 2)`. This is its inverse.

    Args:
        t: [n_head * head_dim, ...] (weight [out, in] or bias [out]).
        n_head: heads of this projection (attention heads for q, KV heads for k).
    Returns:
        Same shape, HF row order, contiguous.
    """
    half = t.shape[0] // n_head // 2
    return t.reshape(n_head, half, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()


class _Reader(GGUFReader):
    """GGUFReader parsing metadata through a plain ndarray view of its file map.

    Slicing an `np.memmap` builds a memmap object per slice; GGUFReader slices once per
    vocabulary entry, so a 49k-token vocabulary takes about 5 s. A base-class view of the
    same mapping parses in about 2 s and gives identical fields and tensor views. If a
    future gguf stops calling `_build_fields`, this is only slower, never wrong.
    """

    def _build_fields(self, offs: int, count: int) -> int:
        if isinstance(self.data, np.memmap):
            self.data = self.data.view(np.ndarray)  # keeps the memmap alive via .base
        return super()._build_fields(offs, count)


def open_gguf(path: Path) -> GGUFReader:
    """Open a GGUF file (metadata parsed, tensors memory-mapped, nothing dequantized).

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: not a GGUF file gguf can read (bad magic, unknown version, truncated).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    try:
        return _Reader(path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({exc})") from exc


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    # GGUF stores floats as float32: give the shortest decimal that round-trips it
    # (1e-05, not 9.999999747378752e-06), as the original config.json had.
    if isinstance(value, float) and f.parts[f.data[0]].dtype == np.float32:
        value = float(str(np.float32(value)))
    return value


def gguf_hf_config(reader: GGUFReader, where: str = "GGUF") -> dict[str, Any]:
    """A transformers `config.json` dict from GGUF metadata.

    Reads `<arch>.context_length, embedding_length, block_count, feed_forward_length,
    attention.head_count, attention.head_count_kv, attention.key_length,
    attention.layer_norm_rms_epsilon, rope.freq_base, rope.scaling.*`; vocab size = rows of
    `token_embd` (the token list length when that tensor is absent); tied embeddings =
    no `output.weight`; bos/eos/pad from `tokenizer.ggml.*`.

    Raises:
        ValueError: unsupported architecture or a required key missing, naming it.
    """
    arch = _field(reader, "general.architecture")
    if arch in HYBRID_ARCHITECTURES:  # lfm2, qwen35: flare.loading.gguf_hybrid
        return hybrid_hf_config(reader, arch, lambda key, default=None:
                                _field(reader, key, default), where)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{where}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {sorted(ARCHITECTURES | HYBRID_ARCHITECTURES)}")

    def req(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{where}: GGUF metadata lacks required key {arch}.{key!s}")
        return value

    names = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in names:
        # Llama 3.x stores its RoPE frequency scaling as a tensor, not as metadata.
        raise ValueError(f"{where}: per-frequency RoPE scaling (rope_freqs.weight, Llama 3.x "
                         f"style) is not supported")
    hidden = int(req("embedding_length"))
    heads = int(req("attention.head_count"))
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ValueError(f"{where}: per-layer KV head counts are not supported")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if "token_embd.weight" in names:
        vocab = int(names["token_embd.weight"].shape[-1])
    elif tokens is not None:
        vocab = len(tokens.data)
    else:
        raise ValueError(f"{where}: neither token_embd.weight nor tokenizer.ggml.tokens")

    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": float(req("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(req("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
    }
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        rope: dict[str, Any] = {"rope_type": scaling,
                                "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
        orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            rope["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = rope
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            cfg[hf_key] = int(value)
    return cfg


def gguf_tensors(reader: GGUFReader, config: ModelConfig, dtype: torch.dtype,
                 progress: bool = False, where: str = "GGUF") -> dict[str, torch.Tensor]:
    """Dequantize every tensor to float32, undo the llama Q/K permutation, cast to `dtype`.

    Returns:
        HF name -> contiguous CPU tensor of `dtype` in HF shape ([out, in] for linears).

    Raises:
        ValueError: a tensor name with no HF equivalent, or a type `gguf` cannot
            dequantize, naming it.
    """
    if not config.is_dense:
        return hybrid_tensors(reader, config, dtype, progress=progress, where=where)
    permute = config.model_type == "llama"
    out: dict[str, torch.Tensor] = {}
    for t in progress_bar(reader.tensors, desc="dequantizing", unit="tensor",
                          disable=not progress):
        name = hf_tensor_name(t.name)
        if name is None:
            raise ValueError(f"{where}: tensor {t.name!r} has no Hugging Face equivalent "
                             f"in the {config.model_type} recipe")
        try:
            arr = dequantize(t.data, GGMLQuantizationType(t.tensor_type))
        except NotImplementedError:
            raise ValueError(f"{where}: tensor {t.name!r} has type "
                             f"{GGMLQuantizationType(t.tensor_type).name}, which gguf "
                             f"cannot dequantize") from None
        if not arr.flags.writeable:  # F32 comes back as a view of the read-only file map
            arr = arr.copy()
        x = torch.from_numpy(arr)
        if permute and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            x = unpermute_qk(x, heads)
        out[name] = x.to(dtype).contiguous()
    return out


def gguf_blocks(reader: GGUFReader, config: ModelConfig,
                where: str = "GGUF") -> dict[str, GGUFBlocks]:
    """Each 2-D weight's GGUF type, with the file's own block bytes for the types the
    quantized formats serve as stored (`GGUF_BLOCK_BYTES`: Q4_0, Q4_1, Q8_0, Q5_0, Q5_1,
    Q4_K, Q5_K, Q6_K).

    The bytes are uint8 [rows, bytes per row] views of the file map (no copy), except for
    a llama q_proj / k_proj, whose rows get the loader's un-permutation (`unpermute_qk`
    moves whole rows, so every block stays intact). HF names, as `gguf_tensors`.

    Raises:
        ValueError: a tensor name with no HF equivalent, or block bytes of an unexpected
            shape (naming the tensor).
    """
    if not config.is_dense:
        return hybrid_blocks(reader, config, where)
    permute = config.model_type == "llama"
    out: dict[str, GGUFBlocks] = {}
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        name = hf_tensor_name(t.name)
        if name is None:
            raise ValueError(f"{where}: tensor {t.name!r} has no Hugging Face equivalent "
                             f"in the {config.model_type} recipe")
        kind = GGMLQuantizationType(t.tensor_type).name
        if kind not in GGUF_BLOCK_BYTES:
            out[name] = GGUFBlocks(kind, None)
            continue
        rows, cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists the fastest axis first
        per_row = cols // GGUF_BLOCK_VALUES[kind] * GGUF_BLOCK_BYTES[kind]
        if (cols % GGUF_BLOCK_VALUES[kind] or t.data.dtype != np.uint8
                or t.data.size != rows * per_row):
            raise ValueError(f"{where}: tensor {t.name!r} ({kind}) has {t.data.size} bytes "
                             f"of blocks, expected {rows} rows of {per_row}")
        with warnings.catch_warnings():  # a read-only view of the file map, never written
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(t.data.reshape(rows, per_row))
        if permute and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            data = unpermute_qk(data, heads)
        out[name] = GGUFBlocks(kind, data)
    return out


def weight_types(reader: GGUFReader) -> dict[str, list[str]]:
    """The GGUF types of the file's 2-D weights, sorted names: {"layers": the transformer
    blocks' projections, "other": the token embedding and output layer}. Decides the
    default weight format (`flare.models.quant.formats.native_format`)."""
    layers, other = set(), set()
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        kind = GGMLQuantizationType(t.tensor_type).name
        (layers if t.name.startswith("blk.") else other).add(kind)
    return {"layers": sorted(layers), "other": sorted(other)}


def load_gguf(path: Path, dtype: torch.dtype = torch.float32, progress: bool = False) -> Checkpoint:
    """Read a GGUF file into a `Checkpoint` (see `flare.loading.checkpoint.load_checkpoint`).

    The tokenizer is transformers' conversion of the GGUF's `tokenizer.ggml.*` metadata,
    with the GGUF `tokenizer.chat_template`. For the embedded model (49k-token vocabulary,
    2 cores): parsing metadata about 2 s, dequantizing about 2 s, transformers' tokenizer
    conversion (which parses the file again) about 5 s.

    Raises:
        FileNotFoundError: no file at `path`.
        ValueError: not a readable GGUF, unsupported architecture/tensor, no chat template.
    """
    path = Path(path)
    where = str(path)
    reader = open_gguf(path)
    hf_config = gguf_hf_config(reader, where)
    config = ModelConfig.from_hf(hf_config)
    recipe_for(config)
    tensors = gguf_tensors(reader, config, dtype, progress=progress, where=where)
    check_tensor_names(tensors, config, where)
    tokenizer = load_tokenizer(path.parent, gguf_file=path.name,
                               chat_template=_field(reader, "tokenizer.chat_template"))
    source = source_identity(path)
    source["weight_types"] = weight_types(reader)
    general_name = _field(reader, "general.name")
    if general_name:
        source["general_name"] = general_name
    return Checkpoint(config=config, hf_config=hf_config, tensors=tensors,
                      tokenizer=tokenizer, source=source,
                      blocks=gguf_blocks(reader, config, where))
