"""Weight formats `q4` and `q4x8` (`flare.models.quant`, `flare.kernels`): the quantizers'
numbers, the C++ kernels against F.linear on the dequantized weights (and, for `q4x8`,
the dequantized int8 activations), the interleaved layout, what a package stores, and
reuse-equals-recompute with quantized weights.

The first test to need the kernel builds it (about a minute on 2 cores) into the flare
cache folder; later runs import the cached build.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn.functional as F

from flare.kernels import cpu_problem
from flare.loading.checkpoint import load_checkpoint
from flare.models.quant.blocks import Q4Weight, Q8Weight, quantize_q4, quantize_q8
from flare.models.quant.formats import check_weight_format, default_kv_dtype
from flare.models.quant.interleaved import Q4x8Weight, Q8x8Weight
from flare.models.quant.linear import Linear, Q_KERNEL_MAX_ROWS
from flare.models.quant.sizes import serving_weight_bytes
from flare.models.quant.stacked import cat_weights
from flare.models.quant.storage import (
    Q4X8_SUFFIXES,
    Q4_SUFFIXES,
    Q8X8_SUFFIXES,
    Q8_SUFFIXES,
    convert_tensors,
    weight_getter,
)
from flare.prepare.package import prepare_package
from flare.package.reader import load_package
from flare.package.plan import make_plan
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, SamplingParams

# the kernel's tests need an x86-64 CPU with AVX2/FMA (elsewhere `q4` is refused at
# prepare, and a q4 package is served dequantized: see test_linear_falls_back_...)
needs_kernel = pytest.mark.skipif(cpu_problem() is not None, reason=str(cpu_problem()))

# ---- quantizers ---------------------------------------------------------------------------


def test_q4_known_block():
    x = torch.arange(32, dtype=torch.float32).view(1, 32) * 0.5 - 3.0  # -3 .. 12.5
    q = quantize_q4(x)
    assert q.scales.item() == pytest.approx(15.5 / 15) and q.mins.item() == -3.0
    codes = torch.cat([q.codes & 0xF, q.codes >> 4], dim=-1)[0]
    assert codes.tolist() == torch.round(torch.arange(32) * 0.5 / (15.5 / 15)).tolist()
    assert codes[0] == 0 and codes[-1] == 15
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (1, 16)
    # a constant block: d = 0, codes 0, value = m exactly
    c = quantize_q4(torch.full((2, 32), 0.25))
    assert torch.equal(c.dequantize(), torch.full((2, 32), 0.25))
    assert int(c.codes.max()) == 0


def test_q8_known_block():
    x = torch.zeros(1, 64)
    x[0, 3], x[0, 7], x[0, 40] = -2.54, 1.27, 0.5
    q = quantize_q8(x)
    assert q.scales[0].tolist() == pytest.approx([0.02, 0.5 / 127])
    assert q.codes[0, 3] == -127 and q.codes[0, 7] == 64 and q.codes[0, 40] == 127
    assert torch.equal(quantize_q8(torch.zeros(3, 32)).dequantize(), torch.zeros(3, 32))


def test_round_trip_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.05
    q4 = quantize_q4(w)
    err = (q4.dequantize() - w).abs().view(64, -1, 32).amax(-1)
    assert bool((err <= q4.scales / 2 * (1 + 1e-5) + 1e-7).all())
    q8 = quantize_q8(w)
    err8 = (q8.dequantize() - w).abs().view(64, -1, 32).amax(-1)
    assert bool((err8 <= q8.scales / 2 * (1 + 1e-5) + 1e-7).all())
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4(torch.randn(4, 48), "odd.weight")


def _q4_1_like(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Floats as a Q4_1 file dequantizes them: float16 d and m, codes spanning 0..15 in
    every block (what Q4_1's reference quantizer writes), value d * q + m in float32."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-4).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.1).half().float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    return (q.float() * d + m).view(n, k), q.view(n, k)


def test_requantizing_q4_1_floats_gives_back_their_blocks():
    w, codes = _q4_1_like(48, 128, seed=3)
    q = quantize_q4(w)
    got = torch.cat([q.codes.view(48, 4, 16) & 0xF, q.codes.view(48, 4, 16) >> 4], -1)
    assert torch.equal(got.view(48, 128).long(), codes)
    assert float((q.dequantize() - w).abs().max()) <= 1e-7  # float32 rounding of d, m
    # Q8_0 floats likewise (float16 d, codes reaching +-127)
    d = (torch.rand(48, 4, 1) * 0.01 + 1e-4).half().float()
    c8 = torch.randint(-127, 128, (48, 4, 32))
    c8[..., 0] = 127
    w8 = (c8.float() * d).view(48, 128)
    assert float((quantize_q8(w8).dequantize() - w8).abs().max()) <= 1e-7


@pytest.mark.slow
def test_embedded_gguf_weights_are_reproduced_exactly(embedded_checkpoint):
    t = embedded_checkpoint.tensors
    names = ["model.embed_tokens.weight"] + [n for n in t if n.startswith("model.layers.0.")
                                             and t[n].dim() == 2]
    assert len(names) == 8
    for name in names:
        q = (quantize_q8 if "embed" in name else quantize_q4)(t[name], name)
        assert torch.equal(q.dequantize(), t[name]), name


# ---- kernel -------------------------------------------------------------------------------

@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 8, 40])
@pytest.mark.parametrize("shape", [(96, 576), (40, 1536), (13, 64)])
def test_kernel_is_the_fp32_product_of_the_dequantized_weights(rows, shape):
    torch.manual_seed(rows)
    w, b = torch.randn(*shape) * 0.05, torch.randn(shape[0])
    x = torch.randn(rows, shape[1])
    for q in (quantize_q4(w), quantize_q8(w)):
        got = Linear(q, b, torch.float32)(x)
        ref = F.linear(x.double(), q.dequantize().double(), b.double()).float()
        assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
        torch.testing.assert_close(got, ref, rtol=0, atol=2e-5)  # summation order only


@needs_kernel
def test_kernel_refuses_bad_inputs():
    from flare.kernels import qgemm

    k = qgemm()
    q = quantize_q4(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="columns"):
        k.q4_linear(torch.randn(2, 32), q.codes, q.scales, q.mins)
    with pytest.raises(RuntimeError, match="float32"):
        k.q4_linear(torch.randn(2, 64).double(), q.codes, q.scales, q.mins)
    assert torch.equal(k.q4_dequantize(q.codes, q.scales, q.mins), q.dequantize())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 40])
@pytest.mark.parametrize("shape", [(96, 576), (40, 1536), (16, 64)])
def test_q4x8_kernel_is_the_product_of_the_dequantized_weights_and_activations(rows, shape):
    torch.manual_seed(rows)
    w, b = torch.randn(*shape) * 0.05, torch.randn(shape[0])
    x = torch.randn(rows, shape[1]) * 3
    x[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    x_int8 = quantize_q8(x).dequantize().double()
    for q in (Q4x8Weight.pack(quantize_q4(w)), Q8x8Weight.pack(quantize_q8(w))):
        got = Linear(q, b, torch.float32)(x)
        ref = F.linear(x_int8, q.dequantize().double(), b.double()).float()
        torch.testing.assert_close(got, ref, rtol=0, atol=3e-5)  # summation order only
        # not the float32 product: the activations were rounded
        assert float((got - F.linear(x, q.dequantize(), b)).abs().max()) > 1e-3


@needs_kernel
def test_q4x8_rows_do_not_depend_on_their_batch():
    torch.manual_seed(1)
    x = torch.randn(13, 576)
    for q in (Q4x8Weight.pack(quantize_q4(torch.randn(64, 576))),
              Q8x8Weight.pack(quantize_q8(torch.randn(64, 576)))):
        lin = Linear(q, None, torch.float32)
        batch = lin(x)
        for r in (0, 4, 12):
            assert torch.equal(lin(x[r:r + 1]), batch[r:r + 1])


@needs_kernel
def test_kernel_quantizes_activations_as_quantize_q8():
    from flare.kernels import qgemm

    torch.manual_seed(2)
    x = torch.randn(5, 128) * torch.logspace(-3, 3, 5)[:, None]
    x[1, 32:64] = 0.0
    x[2, :32] = torch.arange(32) - 15.5  # x / d lands on many halves: ties to even
    codes, scales = qgemm().quantize_rows_q8(x)
    ref = quantize_q8(x)
    assert torch.equal(codes, ref.codes) and torch.equal(scales, ref.scales)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 8])
def test_kernel_quantization_next_to_half_integers_equals_the_division(rows):
    """AVX-512 builds take a block's codes from x * (1 / d) unless some value lies within
    2^-14 of a half-integer, where they divide (qdot8.cpp, quantize_16_blocks): values
    placed 0 to 3 float32 steps either side of (k + 1/2) d, over 36 decades of scale, an
    all-zero block among them, give quantize_q8's codes (torch's x / d, rounded half to
    even) and scales bit for bit, though x * (1 / d) alone rounds some of them the other
    way. One row or 8: the blocks go 16 at a time across rows."""
    from flare.kernels import qgemm

    g = torch.Generator().manual_seed(7 + rows)
    blocks = []
    for scale in torch.logspace(-18, 18, 64, dtype=torch.float64).tolist():
        for _ in range(8):
            amax = scale * (1 + torch.rand((), generator=g, dtype=torch.float64).item())
            d = torch.tensor(amax, dtype=torch.float32) / 127  # the kernel's d, float32
            k = torch.randint(-127, 127, (31,), generator=g, dtype=torch.float64)
            near = ((k + 0.5) * d.double()).float()
            for _ in range(int(torch.randint(0, 4, (), generator=g).item())):
                away = torch.where(torch.rand(31, generator=g) < 0.5, -torch.inf, torch.inf)
                near = torch.nextafter(near, away.float())
            blocks.append(torch.cat([torch.tensor([amax], dtype=torch.float32), near]))
    blocks[3][:] = 0.0
    x = torch.stack(blocks).reshape(rows, -1)
    codes, scales = qgemm().quantize_rows_q8(x)
    ref = quantize_q8(x)
    assert torch.equal(codes, ref.codes) and torch.equal(scales, ref.scales)
    d = ref.scales.repeat_interleave(32, dim=1)
    by_reciprocal = torch.round(x * (1 / d))
    assert (by_reciprocal != torch.round(x / d)).any(), "no value tells the two apart"


def test_interleaved_layout_round_trips_and_fuses():
    torch.manual_seed(3)
    a, b = torch.randn(16, 64), torch.randn(24, 64)
    qa, qb = quantize_q4(a), quantize_q4(b)
    pa = Q4x8Weight.pack(qa)
    assert not torch.equal(pa.codes, qa.codes)  # moved, same shape
    assert pa.codes.shape == qa.codes.shape and pa.scales.dtype == torch.float16
    assert pa.nbytes == qa.codes.nbytes + qa.scales.nbytes // 2 + qa.mins.nbytes // 2
    back = pa.unpack()  # the codes as they were, the scales and mins rounded to float16
    assert torch.equal(back.codes, qa.codes)
    assert torch.equal(back.scales, qa.scales.half().float())
    assert torch.equal(back.mins, qa.mins.half().float())
    fused = cat_weights([pa, Q4x8Weight.pack(qb)])
    assert torch.equal(fused.dequantize(), torch.cat([pa.dequantize(),
                                                      Q4x8Weight.pack(qb).dequantize()]))
    q8 = quantize_q8(b)
    p8 = Q8x8Weight.pack(q8)
    q8_half = Q8Weight(q8.codes, q8.scales.half().float())
    ids = torch.tensor([0, 7, 8, 23, 5])
    assert torch.equal(p8[ids], q8_half[ids])  # the embedding lookup reads the packed rows
    assert torch.equal(p8.dequantize(), q8_half.dequantize())
    with pytest.raises(ValueError, match="'x.odd.weight' has 12 output rows"):
        convert_tensors({"x.odd.weight": torch.randn(12, 64)}, "q4x8")


def test_weight_getter_and_cat_assemble_parts():
    torch.manual_seed(0)
    a, b = torch.randn(8, 64), torch.randn(16, 64)
    stored = convert_tensors({"x.a.weight": a, "x.b.weight": b, "x.norm.weight": torch.ones(64),
                              "lm_head.weight": b}, "q4")
    assert set(stored) == ({f"x.a.weight{s}" for s in Q4_SUFFIXES}
                           | {f"x.b.weight{s}" for s in Q4_SUFFIXES}
                           | {f"lm_head.weight{s}" for s in Q8_SUFFIXES} | {"x.norm.weight"})
    assert stored["x.a.weight.q4_codes"].dtype == torch.uint8
    assert stored["lm_head.weight.q8_codes"].dtype == torch.int8
    get = weight_getter(stored)
    fused = cat_weights([get("x.a.weight"), get("x.b.weight")])
    assert isinstance(fused, Q4Weight) and fused.shape == (24, 64)
    assert torch.equal(fused.dequantize(), torch.cat([quantize_q4(a).dequantize(),
                                                      quantize_q4(b).dequantize()]))
    assert isinstance(get("lm_head.weight"), Q8Weight)
    assert torch.equal(get("x.norm.weight"), torch.ones(64))
    with pytest.raises(ValueError, match="lack tensor 'nope'"):
        get("nope")
    with pytest.raises(ValueError, match="multiple of 32"):
        convert_tensors({"y.weight": torch.randn(4, 40)}, "q4")
    stored = convert_tensors({"x.a.weight": a, "lm_head.weight": b}, "q4x8")
    assert set(stored) == ({f"x.a.weight{s}" for s in Q4X8_SUFFIXES}
                           | {f"lm_head.weight{s}" for s in Q8X8_SUFFIXES})
    get = weight_getter(stored)
    assert isinstance(get("x.a.weight"), Q4x8Weight)
    assert isinstance(get("lm_head.weight"), Q8x8Weight)


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4", "q4x8"])
def test_q4_applies_only_where_the_kernel_serves_it(monkeypatch, fmt):
    check_weight_format(fmt, dtype="float32", device="cpu", recipe="llama")
    for kw in (dict(dtype="bfloat16", device="cpu", recipe="llama"),
               dict(dtype="float32", device="cuda", recipe="llama"),
               dict(dtype="float32", device="cpu", recipe="lfm2")):
        with pytest.raises(ValueError, match=f"'{fmt}' does not apply"):
            check_weight_format(fmt, **kw)
    import flare.kernels

    monkeypatch.setattr(flare.kernels, "qgemm_problem", lambda: "the CPU lacks avx2")
    with pytest.raises(ValueError, match="not available on this machine: the CPU lacks avx2"):
        check_weight_format(fmt, dtype="float32", device="cpu", recipe="llama")


@pytest.mark.parametrize("pack", [False, True])
def test_linear_falls_back_to_dense_without_the_kernel(monkeypatch, pack):
    import flare.kernels
    import flare.models.quant.dense

    def unavailable():
        raise flare.kernels.KernelUnavailable("no C++ compiler")

    monkeypatch.setattr(flare.kernels, "qgemm", unavailable)
    # a machine without the kernels: the dense GEMMs are unavailable too (looked up once)
    monkeypatch.setattr(flare.models.quant.dense, "_DENSE", None)
    q = quantize_q4(torch.randn(16, 64))
    if pack:
        q = Q4x8Weight.pack(q)
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        lin = Linear(q, None, torch.float32)
    x = torch.randn(2, 64)
    assert torch.equal(lin(x), F.linear(x, q.dequantize()))


def test_cpu_problem_reads_the_flags(monkeypatch, tmp_path):
    import flare.kernels as K

    fake = tmp_path / "cpuinfo"
    fake.write_text("processor : 0\nflags : fpu sse2 avx fma\n")
    real = K.Path

    monkeypatch.setattr(K, "Path", lambda p: fake if p == "/proc/cpuinfo" else real(p))
    monkeypatch.setattr(K.platform, "machine", lambda: "x86_64")
    assert K.cpu_problem() == "the CPU lacks avx2 and f16c (from /proc/cpuinfo)"
    monkeypatch.setattr(K.platform, "machine", lambda: "aarch64")
    assert "x86-64" in K.cpu_problem()


def test_build_key_names_the_cpu(monkeypatch):
    """The kernel cache key changes with the CPU flags that matter (AVX-512, VNNI, AMX,
    AVX2 / FMA / F16C) and with the instruction-set target, and not with flags that do
    not: a cache folder shared between machines never loads a build for another CPU."""
    import flare.kernels as K

    base = "fpu sse2 avx avx2 fma f16c bmi2"
    monkeypatch.setattr(K, "cpu_flags", lambda: frozenset(base.split()))
    avx2 = K.build_key()
    assert K.key_cpu_flags(frozenset(base.split() + ["sse4_2", "ht"])) == \
        ["avx", "avx2", "bmi2", "f16c", "fma"]
    monkeypatch.setattr(K, "cpu_flags", lambda: frozenset((base + " ht sse4_2").split()))
    assert K.build_key() == avx2  # flags that decide nothing leave the key alone
    keys = {avx2}
    for extra in ("avx512f avx512bw avx512_vnni", "avx_vnni", "amx_tile amx_int8"):
        monkeypatch.setattr(K, "cpu_flags",
                            lambda e=extra: frozenset((base + " " + e).split()))
        keys.add(K.build_key())
    monkeypatch.setattr(K, "cpu_flags", lambda: frozenset("fpu sse2 avx avx2 fma".split()))
    keys.add(K.build_key())  # no f16c
    assert len(keys) == 5
    monkeypatch.setattr(K, "cpu_flags", lambda: frozenset(base.split()))
    assert K.build_key("avx512vnni") not in keys  # another instruction set (its variants:
    assert K.build_key("avxvnni") not in keys     # test_kernel_variants.py)
    assert K.build_key("avx2") == K.build_key() == avx2


def test_cpu_flags_reads_proc_cpuinfo(monkeypatch, tmp_path):
    import flare.kernels as K

    fake = tmp_path / "cpuinfo"
    fake.write_text("processor : 0\nflags : fpu avx2 avx512f amx_tile\nprocessor : 1\n"
                    "flags : fpu\n")
    real = K.Path
    monkeypatch.setattr(K, "Path", lambda p: fake if p == "/proc/cpuinfo" else real(p))
    assert K.cpu_flags() == {"fpu", "avx2", "avx512f", "amx_tile"}
    assert K.key_cpu_flags(K.cpu_flags()) == ["amx_tile", "avx2", "avx512f"]
    monkeypatch.setattr(K, "Path", lambda p: tmp_path / "missing" if p == "/proc/cpuinfo"
                        else real(p))
    assert K.cpu_flags() is None
    assert K.key_cpu_flags(None)[0].startswith("cap:")


# ---- packages and engines -----------------------------------------------------------------

def _greedy(engine: Engine, ids: list[int], n: int = 12) -> list[int]:
    outs = engine.run_until_idle([GenerationRequest("r", ids, SamplingParams(
        max_tokens=n, temperature=0, ignore_eos=True))])
    return sum((o.token_ids for o in outs["r"]), [])


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4", "q4x8"])
def test_prepare_q4_writes_a_package_serve_loads(tiny_qwen3_dir, tmp_path, fmt):
    ckpt = load_checkpoint(tiny_qwen3_dir)
    m = prepare_package(tiny_qwen3_dir, tmp_path / "pkg", max_seq_len=128, weights=fmt,
                        progress=False)
    assert m.tuning["weights"] == fmt
    stored = convert_tensors(ckpt.tensors, fmt)
    assert m.memory["weights_bytes"] == serving_weight_bytes(stored, fmt, False)
    loaded = load_package(tmp_path / "pkg")
    q4, q8 = (Q4_SUFFIXES, Q8_SUFFIXES) if fmt == "q4" else (Q4X8_SUFFIXES, Q8X8_SUFFIXES)
    assert loaded.tensors["model.layers.0.mlp.up_proj.weight" + q4[0]].dtype == torch.uint8
    assert loaded.tensors["model.embed_tokens.weight" + q8[0]].dtype == torch.int8
    ids = ckpt.tokenizer.encode("The capital of France is", add_special_tokens=False)
    served = _greedy(Engine.from_package(loaded), ids)
    # the pool dtype prepare gives the format (float16 for q4x8, the float32 one for q4)
    plan = make_plan(ckpt.config, max_seq_len=128, max_num_seqs=8,
                     kv_dtype=default_kv_dtype(fmt, dtype="float32", device="cpu"))
    assert served == _greedy(Engine(ckpt.config, plan, stored, ckpt.tokenizer), ids)


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4", "q4x8"])
def test_cli_prepare_accepts_q4(tiny_qwen3_dir, tmp_path, fmt):
    from flare.cli import main

    assert main(["prepare", str(tiny_qwen3_dir), "--out", str(tmp_path / "p"),
                 "--max-seq-len", "64", "--weights", fmt]) == 0
    assert json.loads((tmp_path / "p" / "manifest.json").read_text())["tuning"]["weights"] \
        == fmt


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4", "q4x8"])
def test_q4_reuse_equals_recompute(tiny_qwen3_dir, fmt):
    """A prompt whose first 31-45 tokens are cached (so only its tail is prefilled, in the
    kernel) answers as on an engine without a prefix cache (whole prompt: for `q4` the
    dequantize + MKL path, for `q4x8` the same kernel as every batch)."""
    from engine_helpers import run, words

    ckpt = load_checkpoint(tiny_qwen3_dir)
    stored = convert_tensors(ckpt.tensors, fmt)

    def engine(prefix_cache: bool) -> Engine:
        plan = make_plan(ckpt.config, max_seq_len=512, max_num_seqs=8, max_batch_tokens=128,
                         page_size=16)
        return Engine(ckpt.config, plan, stored, ckpt.tokenizer, namespace="test",
                      prefix_cache=prefix_cache)

    warm, cold = engine(True), engine(False)
    base = words(55, seed=1)
    run(warm, base)
    for p in (31, 32, 45):
        ids = base[:p] + words(9, seed=2)
        got, last = run(warm, ids)
        assert last.num_cached_tokens == p
        assert p + 9 > Q_KERNEL_MAX_ROWS  # the cold prefill takes the dequantize path
        assert got == run(cold, ids)[0]
    warm.check_integrity()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the kernel was there: no dense fallback
        Linear(quantize_q4(torch.randn(8, 32)), None, torch.float32)


@needs_kernel
def test_q4x8_non_finite_activations_give_nan_not_numbers():
    """A NaN or inf in a row makes that row's outputs NaN (max and the int8 conversion
    would otherwise drop it into finite garbage); other rows are untouched."""
    torch.manual_seed(4)
    x = torch.randn(3, 64)
    x[0, 5], x[1, 40] = float("nan"), float("inf")
    for q in (Q4x8Weight.pack(quantize_q4(torch.randn(16, 64))),
              Q8x8Weight.pack(quantize_q8(torch.randn(16, 64)))):
        y = Linear(q, None, torch.float32)(x)
        assert bool(y[:2].isnan().all()) and bool(y[2].isfinite().all())


def test_q4x8_refuses_scales_beyond_float16():
    with pytest.raises(ValueError, match="'x.big.weight' has block scales or mins beyond"):
        convert_tensors({"x.big.weight": torch.randn(8, 64) * 1e6}, "q4x8")
