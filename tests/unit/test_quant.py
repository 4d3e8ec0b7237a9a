"""Weight formats (`flare.models.quant`): the fp16 kernel's numbers, what a package stores
and records, and the weight bytes the memory report counts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from flare.loading.checkpoint import load_checkpoint
from flare.models.llama import LlamaModel
from flare.models.quant.formats import (
    check_weight_format,
    default_weight_format,
    native_q4x8,
    native_q8x8,
)
from flare.models.quant.linear import Linear
from flare.models.quant.sizes import (
    fbgemm_fp16_packed_bytes,
    fp16_packed_bytes,
    serving_weight_bytes,
)
from flare.models.quant.storage import convert_tensors
from flare.prepare.package import ensure_package, prepare_package
from flare.package.reader import PackageTensors, load_package
from flare.package.plan import make_plan
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, SamplingParams


@pytest.mark.parametrize("rows", [1, 8, 100])
def test_fp16_linear_is_fp32_product_of_rounded_weights(rows):
    torch.manual_seed(0)
    w, b = torch.randn(96, 576) * 0.05, torch.randn(96)
    x = torch.randn(rows, 576)
    got = Linear(w.half(), b, torch.float32)(x)
    ref = F.linear(x, w.half().float(), b)  # fp32 math on the float16-rounded weights
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)  # summation order only


def test_full_linear_is_the_float32_product_and_bad_dtype_is_refused():
    w = torch.randn(8, 16)
    x = torch.randn(3, 16)
    # Flare's row-invariant f32 kernel (summation in order), else F.linear itself
    torch.testing.assert_close(Linear(w, None, torch.float32)(x), F.linear(x, w),
                               rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="cannot serve"):
        Linear(w.bfloat16(), None, torch.float32)


def test_convert_tensors_casts_only_2d_weights():
    tensors = {"a.weight": torch.randn(4, 4), "norm.weight": torch.randn(4),
               "q.bias": torch.randn(4)}
    out = convert_tensors(tensors, "fp16")
    assert out["a.weight"].dtype == torch.float16
    assert torch.equal(out["a.weight"], tensors["a.weight"].half())
    assert out["norm.weight"] is tensors["norm.weight"] and out["q.bias"] is tensors["q.bias"]
    assert convert_tensors(tensors, "full") == tensors
    with pytest.raises(ValueError, match="unknown weight format"):
        convert_tensors(tensors, "int3")


def test_weight_format_applies_only_where_fbgemm_serves_it():
    assert default_weight_format(dtype="float32", device="cpu", recipe="llama") == "fp16"
    for kw in (dict(dtype="bfloat16", device="cpu", recipe="llama"),
               dict(dtype="float32", device="cuda", recipe="llama"),
               dict(dtype="float32", device="cpu", recipe="lfm2")):
        assert default_weight_format(**kw) == "full"
        check_weight_format("full", **kw)
        with pytest.raises(ValueError, match="does not apply"):
            check_weight_format("fp16", **kw)


def test_default_format_of_a_q4_1_gguf_is_its_own_blocks_q4x8():
    """The exact default is the native format: `q4x8` for a GGUF of Q4_1 layers (and a
    Q8_0 embedding, as the embedded model) or Q4_0 layers (read from their blocks, never
    re-quantized: tests/unit/test_gguf_blocks.py), `q8x8` for Q8_0 layers, `kx8` for
    K-quant and 5-bit mixes (Q5_K_M among them), `fp16` for any other source."""
    gguf = {"format": "gguf", "weight_types": {"layers": ["Q4_1"], "other": ["Q8_0"]}}
    kw = dict(dtype="float32", device="cpu", recipe="llama")
    assert native_q4x8(gguf) and default_weight_format(**kw, source=gguf) == "q4x8"
    q4_0 = {"format": "gguf", "weight_types": {"layers": ["Q4_0"], "other": ["Q6_K"]}}
    assert default_weight_format(**kw, source=q4_0) == "kx8"  # a K-quant output layer
    q4_0["weight_types"]["other"] = ["Q8_0"]
    assert default_weight_format(**kw, source=q4_0) == "q4x8"
    q8_0 = {"format": "gguf", "weight_types": {"layers": ["Q8_0"], "other": ["Q8_0"]}}
    assert native_q8x8(q8_0) and default_weight_format(**kw, source=q8_0) == "q8x8"
    for types in ({"layers": ["Q4_1", "Q8_0"], "other": ["Q8_0"]},  # stacked: kx8
                  {"layers": ["Q4_1", "Q6_K"], "other": ["Q8_0"]},
                  {"layers": ["Q5_K", "Q6_K"], "other": ["Q5_K"]},  # Q5_K_M
                  {"layers": ["Q5_1", "Q5_K", "Q6_K"], "other": ["Q6_K"]}):
        source = {"format": "gguf", "weight_types": types}
        assert not native_q4x8(source) and not native_q8x8(source)
        assert default_weight_format(**kw, source=source) == "kx8"
    for types in ({"layers": ["Q3_K", "Q6_K"], "other": ["Q8_0"]},
                  {"layers": ["F16"], "other": ["F16"]}, {}):
        source = {"format": "gguf", "weight_types": types}
        assert not native_q4x8(source) and not native_q8x8(source)
        assert default_weight_format(**kw, source=source) == "fp16"
    assert default_weight_format(**kw, source={"format": "safetensors"}) == "fp16"
    assert default_weight_format(dtype="float32", device="cpu", recipe="lfm2",
                                 source=gguf) == "full"


def test_packed_bytes_pad_the_output_axis_to_16():
    assert fp16_packed_bytes(960, 576) == 576 * 960 * 2  # Flare's panels: no input padding
    assert fp16_packed_bytes(576, 1536) == 1536 * 576 * 2
    assert fp16_packed_bytes(17, 512) == 512 * 32 * 2
    assert fbgemm_fp16_packed_bytes(960, 576) == 1024 * 960 * 2  # the fallback's layout


@pytest.mark.parametrize("fmt", ["full", "fp16", "q4"])
@pytest.mark.parametrize("tied", [False, True])
def test_memory_report_weight_bytes_are_what_the_model_holds(make_tiny_qwen3, tmp_path,
                                                              embedded_checkpoint, fmt, tied):
    make_tiny_qwen3(tmp_path / "m", embedded_checkpoint.tokenizer, tie_word_embeddings=tied)
    ckpt = load_checkpoint(tmp_path / "m")
    stored = convert_tensors(ckpt.tensors, fmt)
    model = LlamaModel(ckpt.config, stored, max_positions=64)
    c = ckpt.config  # Qwen3's q/k norms become one [H + KVH, D] table per layer
    qk_norm_table = c.num_hidden_layers * (c.num_attention_heads + c.num_key_value_heads
                                           - 2) * c.head_dim * 4
    assert model.weights_nbytes == serving_weight_bytes(stored, fmt, tied) + qk_norm_table


def _greedy(engine: Engine, ids: list[int], n: int = 12) -> list[int]:
    outs = engine.run_until_idle([GenerationRequest("r", ids, SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True))])
    return sum((o.token_ids for o in outs["r"]), [])


def test_prepare_records_fp16_and_serves_the_stored_weights(tiny_qwen3_dir, tmp_path):
    ckpt = load_checkpoint(tiny_qwen3_dir)
    m = prepare_package(tiny_qwen3_dir, tmp_path / "pkg", max_seq_len=128, progress=False)
    assert m.tuning["weights"] == "fp16" and m.dtype == "float32"
    stored = convert_tensors(ckpt.tensors, "fp16")
    assert m.memory["weights_bytes"] == serving_weight_bytes(stored, "fp16", False)
    loaded = load_package(tmp_path / "pkg")
    assert isinstance(loaded.tensors, PackageTensors)
    assert loaded.tensors["model.layers.0.mlp.up_proj.weight"].dtype == torch.float16
    assert loaded.tensors["model.norm.weight"].dtype == torch.float32
    with pytest.raises(KeyError):
        loaded.tensors["nope"]
    ids = ckpt.tokenizer.encode("The capital of France is", add_special_tokens=False)
    served = _greedy(Engine.from_package(loaded), ids)
    plan = make_plan(ckpt.config, max_seq_len=128, max_num_seqs=8)
    assert served == _greedy(Engine(ckpt.config, plan, stored, ckpt.tokenizer), ids)


def test_prepare_full_weights_and_reuse_by_format(tiny_qwen3_dir, tmp_path):
    m = prepare_package(tiny_qwen3_dir, tmp_path / "full", max_seq_len=128, weights="full",
                        progress=False)
    assert m.tuning["weights"] == "full"
    assert load_package(tmp_path / "full").tensors["lm_head.weight"].dtype == torch.float32
    with pytest.raises(ValueError, match="does not apply"):
        prepare_package(tiny_qwen3_dir, tmp_path / "bf", dtype="bfloat16", weights="fp16",
                        progress=False)
    cache = tmp_path / "cache"
    first = ensure_package(tiny_qwen3_dir, cache, max_seq_len=128, weights="full",
                           progress=False)
    manifest = json.loads((first / "manifest.json").read_text())
    assert manifest["tuning"]["weights"] == "full"
    again = ensure_package(tiny_qwen3_dir, cache, max_seq_len=128, progress=False)
    assert json.loads((again / "manifest.json").read_text())["tuning"]["weights"] == "fp16"


def test_cli_prepare_weights_flag(tiny_qwen3_dir, tmp_path, capsys):
    from flare.cli import main

    assert main(["prepare", str(tiny_qwen3_dir), "--out", str(tmp_path / "p"),
                 "--max-seq-len", "64", "--weights", "full"]) == 0
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["tuning"]["weights"] \
        == "full"
    with pytest.raises(SystemExit) as e:
        main(["prepare", str(tiny_qwen3_dir), "--out", str(tmp_path / "q"), "--weights", "int3"])
    assert e.value.code == 2


def test_fp16_never_turns_a_weight_infinite(tiny_qwen3_dir, tmp_path):
    from flare.prepare.package import write_package

    ckpt = load_checkpoint(tiny_qwen3_dir)
    ckpt.tensors["model.layers.1.mlp.down_proj.weight"][0, 0] = 1e6
    with pytest.raises(ValueError, match="down_proj.*beyond float16"):
        convert_tensors(ckpt.tensors, "fp16")
    m = write_package(ckpt, tmp_path / "pkg", max_seq_len=64, progress=False)
    assert m.tuning["weights"] == "full"  # the default falls back; asked for, fp16 raises
    with pytest.raises(ValueError, match="beyond float16"):
        write_package(ckpt, tmp_path / "pkg16", max_seq_len=64, weights="fp16",
                      progress=False)


# ---- decode fast paths (same numbers, fewer operations) -----------------------------------

def test_decode_span_reads_a_view_with_the_gathers_result():
    from flare.models.attention import AttentionBatch, DecodeGroup, paged_attention
    from flare.runtime.forward import _decode_group

    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(64 * 16, 2, 16), torch.randn(64 * 16, 2, 16)
    q = torch.randn(1, 4, 16)
    group = _decode_group([[5, 6, 7, 9]], [45], 16)  # 45 positions: pages 5, 6, 7
    assert group.span == 5 * 16
    assert _decode_group([[5, 7, 8]], [45], 16).span is None  # not consecutive
    assert _decode_group([[5, 6, 7], [1, 2, 3]], [45, 45], 16).span is None  # B > 1
    gathered = DecodeGroup(1, group.gather, None)
    slots = torch.tensor([5 * 16 + 44])
    fast = paged_attention(q, k_cache, v_cache, AttentionBatch(slots, group, ()), 0.25)
    ref = paged_attention(q, k_cache, v_cache, AttentionBatch(slots, gathered, ()), 0.25)
    assert torch.equal(fast, ref)
