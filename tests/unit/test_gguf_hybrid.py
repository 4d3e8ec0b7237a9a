"""Hybrid GGUF files (issue 18, part 5): llama.cpp's `lfm2` and `qwen35` architectures.

Tiny random LFM2 and Qwen3.5 models (hidden 256, so K-quant blocks of 256 fit; Qwen3.5
with 2 key heads and 4 value heads, so llama.cpp's value-head reorder is exercised) are
written as GGUF files with the `gguf` package's writer the way llama.cpp's converter writes
them: its tensor names (`gguf.get_tensor_name_map`, the converter's own map), its
metadata keys, and its transformations (conv kernels squeezed, Qwen3.5 norms stored as
1 + w, A_log as -exp(A_log), dt_bias as `ssm_dt.bias`, value heads tiled), with the
embedded model's tokenizer. Two type mixes: all F32, and llama.cpp's Q4_K_M kind of mix
(Q4_K, Q6_K for v_proj and the output layer, where the input axis is a multiple of 256;
Q8_0 elsewhere, as its quantizer falls back, and for the token embedding). The
state-related tensors (conv, A_log, dt bias, norms) stay F32, as the converter keeps them.

The same model is saved as a safetensors folder whose weights are the file's values (each
quantized tensor's dequantization, in Hugging Face layout), so "the same weights" holds
exactly and the bound for every mix is zero: the GGUF's tensors equal the folder's (for
Qwen3.5's norms and A_log, what the recipe computes from them: the scale 1 + w and the
decay -exp(A_log), since the file holds fl(1 + w) and -exp(A_log)), and its logits
(torch.equal) and greedy tokens equal the folder's, loaded and as prepared packages.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import greedy, run, small_engine, words
from exactness import assert_same_logits, run_recorded
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf.quants import dequantize, quantize
from gguf_files import add_shape, add_tokenizer, close_gguf, tokenizer_fields_of
from hybrid_models import (
    LFM2_RULES,
    QWEN3_5_RULES,
    _random_model,
    lfm2_config,
    qwen3_5_config,
)

from flare.loading.checkpoint import load_checkpoint
from flare.loading.gguf import open_gguf
from flare.loading.gguf_hybrid import hybrid_tensor_name, tiled_to_grouped
from flare.models.recipe import recipe_config

T = GGMLQuantizationType
ARCH = {"lfm2": MODEL_ARCH.LFM2, "qwen35": MODEL_ARCH.QWEN35}
MIXES = ("F32", "K")  # K: Q4_K, Q6_K and Q8_0 linear weights, as a Q4_K_M file mixes them
HK, HV, DK, DV = 2, 4, 16, 8  # Qwen3.5 DeltaNet heads: fewer key heads than value heads
OFFSET_NORMS = ("layernorm.weight", "model.norm.weight", "q_norm.weight", "k_norm.weight")


def qwen35_config():
    """The tiny Qwen3.5 at hidden 256 with llama.cpp's layer rule (full attention every
    `full_attention_interval`-th layer, here 2)."""
    d = qwen3_5_config("tiny").to_dict()
    d.update(hidden_size=256, intermediate_size=256, layer_types=[
        "full_attention" if (i + 1) % 2 == 0 else "linear_attention" for i in range(5)],
        linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=DK,
        linear_value_head_dim=DV, bos_token_id=1, eos_token_id=2)
    return type(qwen3_5_config("tiny"))(**d)


def lfm2_gguf_config():
    d = lfm2_config("tiny").to_dict()
    d.update(hidden_size=256, intermediate_size=256, block_auto_adjust_ff_dim=False)
    return type(lfm2_config("tiny"))(**d)


# ---- llama.cpp's converter, as convert_hf_to_gguf.py writes these architectures -----------

def _to_tiled(t: torch.Tensor, dim: int, head_dim: int) -> torch.Tensor:
    """`_LinearAttentionVReorderBase._reorder_v_heads`: grouped by key head -> tiled."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], HK, HV // HK, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def converter(arch: str, name: str, t: torch.Tensor) -> tuple[str, torch.Tensor]:
    """(GGUF name, tensor as llama.cpp stores it) of a Hugging Face tensor."""
    if arch == "lfm2":
        if ".conv.conv.weight" in name:
            t = t.squeeze(1)
    elif ".linear_attn." in name:
        qk = 2 * HK * DK
        if ".in_proj_qkv." in name:
            t = torch.cat([t[:qk], _to_tiled(t[qk:], 0, DV)])
        elif ".in_proj_z." in name:
            t = _to_tiled(t, 0, DV)
        elif ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name \
                or ".dt_bias" in name:
            t = _to_tiled(t, 0, 1)
        elif ".conv1d" in name:
            t = t.squeeze()
            t = torch.cat([t[:qk], _to_tiled(t[qk:], 0, DV)])
        elif ".out_proj." in name:
            t = _to_tiled(t, 1, DV)
        if name.endswith(".A_log"):
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif name.endswith("norm.weight"):  # Qwen3Next: every norm but linear_attn.norm
        t = t + 1
    gname = get_tensor_name_map(ARCH[arch], 5).get_name(name, try_suffixes=(".weight", ".bias"))
    assert gname is not None, name
    return gname, t.contiguous()


def kind_of(mix: str, name: str, t: torch.Tensor) -> str:
    """The GGUF type a tensor gets in `mix`: F32 for every state-related and 1-D tensor."""
    if t.dim() != 2 or mix == "F32" or ".conv.conv." in name or ".conv1d." in name:
        return "F32"
    if "embed_tokens" in name:
        return "Q8_0"
    if "lm_head" in name or ".v_proj." in name:
        return "Q6_K" if t.shape[1] % 256 == 0 else "Q8_0"
    return "Q4_K" if t.shape[1] % 256 == 0 else "Q8_0"


def random_k_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random but well-formed K-quant blocks (ggml's block_q4_K / block_q6_K layouts)
    with super-block scales that keep the values near the model's init range."""
    size = {"Q4_K": 144, "Q6_K": 210}[kind]
    b = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    if kind == "Q4_K":  # d, dmin (float16) first
        b[..., 0:2] = np.full((rows, cols // 256, 1), 2e-4, np.float16).view(np.uint8)
        b[..., 2:4] = np.full((rows, cols // 256, 1), 2e-3, np.float16).view(np.uint8)
    else:  # ql, qh, int8 scales, then d (float16) last
        b[..., 208:210] = np.full((rows, cols // 256, 1), 1e-5, np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def write_pair(arch: str, mix: str, root, tok_fields: dict, tokenizer, seed: int = 7):
    """Write the tiny `arch` model as `root/<arch>-<mix>.gguf` and as a safetensors folder
    holding the file's values; returns (gguf path, folder)."""
    cfg = qwen35_config() if arch == "qwen35" else lfm2_gguf_config()
    model = _random_model(cfg, seed, QWEN3_5_RULES if arch == "qwen35" else LFM2_RULES)
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(root / f"{arch}-{mix}.gguf"), arch)
    add_shape(w, f"tiny {arch}", cfg)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    if arch == "lfm2":
        w.add_head_count_kv([cfg.num_key_value_heads if t != "conv" else 0
                             for t in cfg.layer_types])
        w.add_vocab_size(cfg.vocab_size)
        w.add_shortconv_l_cache(cfg.conv_L_cache)
        w.add_layer_norm_rms_eps(cfg.norm_eps)
    else:
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        w.add_ssm_state_size(DK)
        w.add_ssm_group_count(HK)
        w.add_ssm_time_step_rank(HV)
        w.add_ssm_inner_size(HV * DV)
        w.add_full_attention_interval(2)
        w.add_rope_dimension_count(int(cfg.head_dim * 0.25))
        w.add_rope_dimension_sections([1, 1, 0, 0])
    add_tokenizer(w, tok_fields)
    state = model.state_dict()
    for name, t in list(state.items()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname, g = converter(arch, name, t)
        kind = kind_of(mix, name, t)
        if kind == "F32":
            w.add_tensor(gname, g.numpy())
            continue
        rows, cols = g.shape
        blocks = (quantize(g.numpy(), T[kind]) if kind == "Q8_0"
                  else random_k_blocks(kind, rows, cols, rng))
        w.add_tensor(gname, blocks, raw_shape=blocks.shape, raw_dtype=T[kind])
        # the folder holds the file's values: the permutation the converter applied,
        # followed back on an index grid (independent of the loader's undo)
        values = torch.from_numpy(dequantize(blocks, T[kind]).copy()).reshape(-1)
        index = converter(arch, name, torch.arange(t.numel()).reshape(t.shape))[1].reshape(-1)
        hf = torch.empty(t.numel())
        hf[index] = values
        state[name].copy_(hf.reshape(t.shape))
    close_gguf(w)
    folder = root / f"{arch}-{mix}-folder"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return root / f"{arch}-{mix}.gguf", folder


@pytest.fixture(scope="module")
def tok_fields(embedded_gguf):
    return tokenizer_fields_of(embedded_gguf)


@pytest.fixture(scope="module")
def files(tmp_path_factory, tok_fields, smollm2_tokenizer):
    """(arch, mix) -> (gguf path, folder), each pair written once for the module."""
    root, made = tmp_path_factory.mktemp("hybrid-gguf"), {}

    def get(arch: str, mix: str):
        if (arch, mix) not in made:
            made[arch, mix] = write_pair(arch, mix, root, tok_fields, smollm2_tokenizer)
        return made[arch, mix]

    return get


@pytest.fixture(scope="module", params=[(a, m) for a in ("lfm2", "qwen35") for m in MIXES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, files):
    arch, mix = request.param
    path, folder = files(arch, mix)
    return arch, mix, path, load_checkpoint(path), load_checkpoint(folder)


# ---- names, config, tensors ----------------------------------------------------------------

def test_reorder_inverse_undoes_the_converters_value_head_order():
    x = torch.arange(HV * DV * 3).reshape(HV * DV, 3)
    assert torch.equal(tiled_to_grouped(_to_tiled(x, 0, DV), 0, HK, HV // HK, DV), x)
    assert torch.equal(tiled_to_grouped(_to_tiled(x.T, 1, DV), 1, HK, HV // HK, DV), x.T)
    assert not torch.equal(_to_tiled(x, 0, DV), x)  # the tiny model's reorder is not a no-op


def test_every_tensor_name_is_gguf_py_s_name_for_it(pair):
    arch, _, path, ckpt, _ = pair
    gmap = get_tensor_name_map(ARCH[arch], 5)
    for t in open_gguf(path).tensors:
        _, name = hybrid_tensor_name(arch, t.name)
        hf = name.replace(".dt_bias", ".dt_proj.bias")
        assert gmap.get_name(hf, try_suffixes=(".weight", ".bias")) == t.name
        assert name in ckpt.tensors


def test_config_equals_the_folders(pair):
    arch, mix, _, g, f = pair
    assert recipe_config(g.config) == recipe_config(f.config)
    assert g.config.vocab_size == f.config.vocab_size == 49152
    assert g.source["format"] == "gguf" and g.source["general_name"] == f"tiny {arch}"
    kinds = set(g.source["weight_types"]["layers"]) | set(g.source["weight_types"]["other"])
    want = {"F32": {"F32"}, "K": {"Q4_K", "Q6_K", "Q8_0", "F32"}}[mix]
    assert kinds == want
    from transformers import AutoConfig

    AutoConfig.for_model(**{k: v for k, v in g.hf_config.items() if k != "architectures"})


def test_tensors_equal_the_folders_bit_for_bit(pair):
    arch, _, _, g, f = pair
    assert g.tensors.keys() == f.tensors.keys()
    for name, t in f.tensors.items():
        if name.endswith(".A_log"):  # the decay the recipe computes, -exp(A_log), is the file's
            assert torch.equal(-g.tensors[name].exp(), -t.exp()), name
        elif arch == "qwen35" and name.endswith(OFFSET_NORMS):
            # the file holds fl(1 + w), so w itself is lost below its last bits; the scale
            # the recipe computes, 1 + w in float32, is the same bit for bit
            assert torch.equal(1.0 + g.tensors[name], 1.0 + t), name
        else:
            assert torch.equal(g.tensors[name], t), name


def test_tokenizer_and_chat_template_come_from_the_file(pair, smollm2_tokenizer):
    _, _, _, g, _ = pair
    text = "def reverse_string(s):\n    return s[::-1]  # café 推理"
    assert g.tokenizer.encode(text) == smollm2_tokenizer.encode(text)
    assert g.tokenizer.chat_template


def test_logits_and_greedy_tokens_equal_the_folders(pair):
    """Two prompts at once (a 40-token and a 7-token one), 12 greedy tokens each: every
    sampled step's logits are bit-identical (torch.equal), so are the tokens."""
    _, _, _, g, f = pair
    prompts = {"a": words(40, seed=5), "b": words(7, seed=6)}
    got = run_recorded(small_engine(g), prompts, 12)
    want = run_recorded(small_engine(f), prompts, 12)
    for rid in prompts:
        assert_same_logits(got[rid][1], want[rid][1], rid)
        assert got[rid][0] == want[rid][0] and len(got[rid][0]) == 12


# ---- prepared packages ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("arch", ["lfm2", "qwen35"])
def test_prepared_package_of_a_k_quant_gguf_serves_the_folders_tokens(arch, tmp_path, files):
    from flare.package.reader import load_package
    from flare.prepare.package import prepare_package
    from flare.runtime.engine import Engine

    path, folder = files(arch, "K")
    answers = []
    for src, out in ((path, tmp_path / "pkg-gguf"), (folder, tmp_path / "pkg-folder")):
        manifest = prepare_package(src, out, max_seq_len=256, max_num_seqs=2, page_size=16,
                                   max_batch_tokens=64, progress=False)
        assert manifest.tuning["weights"] == "full"  # the hybrid recipes' format
        answers.append(run(Engine.from_package(load_package(out)), words(30, seed=9),
                           greedy(10))[0])
    assert answers[0] == answers[1]
    assert manifest.recipe == {"lfm2": "lfm2", "qwen35": "qwen3_5"}[arch]


def test_a_qwen35_file_whose_layers_break_the_interval_is_refused(tmp_path, tok_fields):
    from flare.loading.gguf import gguf_hf_config

    w = GGUFWriter(str(tmp_path / "bad.gguf"), "qwen35")
    for key, value in (("context_length", 64), ("embedding_length", 32), ("block_count", 2),
                       ("feed_forward_length", 64), ("attention.head_count", 2),
                       ("attention.head_count_kv", 1), ("attention.layer_norm_rms_epsilon", 1e-6),
                       ("full_attention_interval", 2), ("rope.dimension_count", 4),
                       ("ssm.conv_kernel", 4), ("ssm.state_size", 8), ("ssm.group_count", 1),
                       ("ssm.time_step_rank", 2), ("ssm.inner_size", 16)):
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"qwen35.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((10, 32), np.float32))
    w.add_tensor("blk.1.ssm_a", np.zeros(2, np.float32))  # layer 1 should be full attention
    close_gguf(w)
    with pytest.raises(ValueError, match="full_attention_interval 2"):
        gguf_hf_config(open_gguf(tmp_path / "bad.gguf"), "bad.gguf")
