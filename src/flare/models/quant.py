"""Weight formats of the linear layers: chosen by `prepare`, stored in the package, run here.

A format says how the 2-D weights of a dense (`llama` recipe) model are stored and
multiplied; activations, norms, biases and the KV cache stay in the serving dtype.

- `full`: every weight in the serving dtype. On CPU with a float32 serving dtype the 2-D
  weights are packed at load into 16-output panels (`dense_panel_bytes`) and multiplied
  by Flare's row-invariant float32 kernel (`f32_linear`, below); elsewhere `F.linear`.
- `fp16`: the 2-D weights (q/k/v/o, gate/up/down, token embedding, output layer) stored
  as float16 (round to nearest even), for a float32 serving dtype. On CPU they are
  packed at load into Flare's float16 panel layout ([ceil(out/16), in, 16], the output
  axis padded to a multiple of 16 with zeros, no input-axis padding) and multiplied by
  Flare's dense kernel (`flare.kernels`, dense.cpp: `f16_linear`), which widens them to
  float32 in registers exactly (F16C) and accumulates in float32. The result is a float32
  product with the float16-rounded weights: what transformers computes on the same
  weights upcast to float32, up to summation order. Decode reads half the bytes of
  `full`. The token embedding is looked up from its float16 table and widened exactly.
  On other devices the weights are widened to the serving dtype at load (no speed gain,
  same values).

  Row invariance: the dense kernels compute every output element as one FMA chain over
  the input axis in order from 0.0 (then + bias, one rounding), whatever the number of
  rows in the call, the register tile that computes it or the thread count. A row's
  result is bit for bit the same alone, in a prompt, or beside other sequences
  (tests/unit/test_dense_kernels.py). fbgemm's fp16 GEMM and MKL's sgemm, which these
  formats ran on before, are not: they pick their blocking (so their summation order) by
  the row count (fbgemm's rows differed between 1-2 rows and 3+, MKL's for many row
  counts). Where Flare's kernels cannot be had (`flare.kernels.KernelUnavailable`: no
  AVX2/FMA/F16C, no compiler or ninja) `fp16` falls back to fbgemm's fp16 GEMM
  (`quantized::linear_dynamic_fp16`, its own packed layout: `fbgemm_fp16_packed_bytes`)
  and `full` to `F.linear`, without row invariance.

  Measured on the 2-core AVX2 machine (Zen 3, shared with other jobs, so absolute
  figures are low), the 30 layers' four matmuls of the embedded model (float16 weights,
  streamed from memory), one thread, medians of 7 interleaved runs (3 at 512 rows),
  fbgemm / Flare:
  30.4 / 17.1 ms at 1 row, 35.7 / 23.9 at 2, 35.9 / 30.1 at 4, 61.2 / 49.7 at 8,
  87.6 / 83.6 at 16, 287 / 269 at 64, 1975 / 1941 at 512 (the kernel's 6 x 16 prompt
  tile runs at about 28 GMAC/s per core). Engine, embedded model in `fp16`, one thread,
  medians of 4 interleaved rounds, fbgemm / Flare: decode at batch 1 40.5 / 53.8 tok/s,
  8 streams 159.8 / 171.5 aggregate, prefill 512 tokens 316 / 318 tok/s; weights held
  494 / 326 MB (fbgemm pads the 576-wide input axis to 1024).

Earlier measurement (same machine, one thread, thread CPU time, one layer's four matmuls
of the embedded model with 30 layers' weights streamed from memory, medians of 5) of
fp32 (MKL) against fbgemm fp16: fp32 1.22 ms at 1 token, 2.82 ms at 8, 50.8 ms at 512;
fp16 0.78 / 1.37 / 46.3 ms. PyTorch's weight-only int8 and int4 CPU kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) have no AVX2 path in torch 2.13:
5.2 ms at 1 token (4x slower than fp32), 52.6 ms at 8, 3.2 s at 512 (int4 slower still);
`torch._int_mm` is slower again. They are not offered as formats.

- `q4`: Flare's own 4-bit format with an AVX2/FMA C++ kernel (`flare.kernels`), for a
  float32 serving dtype on x86-64 CPUs with AVX2 and FMA, recipe `llama`. Every 2-D
  projection weight [out, in] (`in` a multiple of 32) is stored in blocks of 32 along
  `in` with Q4_1's scheme (`quantize_q4`): per block a scale d and a min m (float32) and
  32 codes q in 0..15 packed two per byte; value = d * q + m. The token embedding and
  the output layer are stored Q8_0-style (`quantize_q8`): per block of 32 a float32
  scale d = amax / 127 and int8 codes; value = d * q. A package stores the parts under
  the weight's name plus a suffix (`Q4_SUFFIXES`, `Q8_SUFFIXES`). Activations stay
  float32 and are never quantized: the kernel computes, per block,
  d * sum_j(x_j * q_j) + m * sum_j(x_j) in float32, so its result is the float32
  product with the dequantized weights up to summation order. The GGUF of the embedded
  model holds Q4_1 layers and a Q8_0 embedding; re-quantizing its dequantized floats
  gives back the same codes and, for d and m, the file's float16 values within float32
  rounding: measured over all 211 2-D weights of the embedded model, the dequantized
  `q4` weights equal the GGUF's dequantized floats exactly (max abs difference 0.0).
  Decode reads 0.75 bytes per layer weight (24 bytes
  per block of 32; float16 scales would make it 20, 17% less, at the cost of rounding
  non-GGUF scales: not done, float32 keeps the reproduction exact) and 1.125 per
  embedding weight: 111 MB per token for the embedded model against 270 MB for `fp16`.
  Up to `Q_KERNEL_MAX_ROWS` rows per call (decode) run in the kernel; larger calls
  (prefill) dequantize the weight into a float32 scratch buffer and use `F.linear`
  (MKL). Where the kernel cannot be built (no AVX2/FMA, no compiler or ninja) `prepare`
  refuses `q4` naming why; a `q4` package served on such a machine is dequantized to
  float32 at load (with a warning), so it still runs, with `full`'s speed and memory.

  Measured on the 2-core AVX2 machine (Zen 3), one thread, CPU time, min of 5, while
  other jobs ran on the machine (so absolute figures are low; compare columns): the 30
  layers' four matmuls of the embedded model, fbgemm fp16 / q4 kernel: 17.9 / 9.8 ms at 1
  row (1.8x), 18.8 / 17.9 at 2, 20.7 / 22.8 at 4, 30.4 / 45.3 at 8, 45.8 / 90.8 at 16;
  dequantize + MKL 89.2 at 17 rows and 1341 / 1251 (fp16) at 512. The output layer,
  fbgemm fp16 / q8 kernel: 3.4 / 2.3 ms at 1 row, 7.7 / 6.4 at 8. Per row the kernel
  spends 4 FP ops per 8 weights turning nibbles into floats (shift, mask, convert,
  scale) where fbgemm spends 1 (fp16 convert), so it wins where decode is bound by
  reading weights (1-2 rows) and loses where it is bound by arithmetic (4+ rows).
  Engine, one thread: decode at batch 1 29.1 (fp16) / 40.0 (q4) tok/s, 8 streams
  130.5 / 105.2 aggregate tok/s, prefill 512 tokens 301 / 267 tok/s, 2048 tokens
  213 / 205 tok/s (bench/peers.py prints the same rows at 2 threads).

- `q4x8`: `q4`'s blocks (same quantizers, same bytes) with llama.cpp's arithmetic for
  them: every linear layer's input row is quantized per block of 32 to int8 exactly as
  `quantize_q8` quantizes a weight, and each block's dot product is an integer sum
  (AVX2 `vpmaddubsw`), scaled in float32 (`flare.kernels` qdot8.cpp; Q4_1 x Q8_1 for the
  layers, Q8_0 x Q8_0 for the embedding / output layer). The result is the float32
  product of the dequantized weights and the dequantized activations (tests check it
  against transformers with every linear layer's input so rounded). The weights are
  stored with 8 rows interleaved (`Q4x8Weight`, `Q8x8Weight`: one 32-byte load feeds 8
  outputs), so every 2-D weight needs a multiple of 8 rows, and with float16 scales and
  mins, as the GGUF holds them (exact for the embedded model; other weights' scales are
  rounded to float16): 20 bytes per layer block and 34 per output-layer block, 96 MB per
  decoded token of the embedded model. The kernel runs every batch
  size, prompts included (no dequantize + MKL path): a linear layer's result for a row
  never depends on the rows beside it, and with the rest of the serving path fixed-order
  too (attention, norms, activation rounding: docs/preparation-contract.md,
  "Exactness") a request's logits do not depend on chunking, reuse or batch. It is the
  default for a GGUF of Q4_1 or Q4_0 layers (`default_weight_format`), built from the
  file's own blocks (`convert_tensors(..., blocks=)`, `native_weight`): Q4_1 blocks as
  they are, a Q4_0 block (d, codes q, value d * (q - 8)) as the Q4_1 block with scale d
  and min -8d, the same codes, exact; a Q8_0, Q4_0 or Q4_1 embedding / output layer as
  its own blocks, an F16 / BF16 / F32 one as a float tensor run by the dense kernels.
  Activation rounding moves
  the embedded model's logits by up to about 1.7 against the float product (next-token
  agreement 92 of 96 teacher-forced positions, KL mean 2.8e-3, see
  tests/unit/test_quant_parity.py);
  `q4` keeps float32 activations.

  Measured on the 2-core AVX2 machine (`bench/peers.py --weights fp16,q4,q4x8 --repeat
  3`, medians of 3 interleaved rounds, 2 threads), fp16 / q4 / q4x8 / llama.cpp on the
  same GGUF: decode at batch 1 48.9 / 72.9 / 108.0 / 101.5 tok/s, 8 streams 218.9 /
  179.3 / 351.1 / - aggregate, prefill 512 tokens 490 / 451 / 612 / 187, 2,048 tokens
  383 / 362 / 455 / 157 tok/s. Kernel alone, 2 threads, weights in cache, float32
  scales: gate/up (3072 x 576) and q/k/v (960 x 576) one after the other 41 us at 1 row,
  190 at 8; gate/up alone about 70 GMAC/s from 4 rows up.

- `q8x8`: every 2-D weight in Q8_0 blocks (float16 d, 32 int8 codes, value d * q) in
  `q4x8`'s 8-row interleaved layout (`Q8x8Weight`, 34 bytes a block), run by the same
  Q8_0 x Q8_0 kernel as `q4x8`'s output layer (`q8x8_linear`): int8 activations per
  block of 32, integer dot products, then the scales; the same row invariance. The
  default for a GGUF of Q8_0 layers (Q4_0 layers beside them become Q8_0 blocks with
  codes q - 8, exact), built from the file's blocks as `q4x8` is; from floats (a
  safetensors folder, other GGUF types, asked for with --weights q8x8) `quantize_q8`,
  which gives back a reference-quantized Q8_0 file's codes and float16 scales exactly.
  Decode reads 1.06 bytes per weight against `fp16`'s 2.

- `kx8`: a GGUF's blocks as the file stores them, whatever mix of Q4_K, Q6_K, Q5_0, Q8_0,
  Q4_0 and Q4_1 it holds (llama.cpp's Q4_K_M, Q6_K, and the Q5_0 / Q8_0 its quantizer
  falls back to where an input axis is not a multiple of 256), on the int8-activation
  kernels with `q4x8`'s row invariance: Q4_K as `Q4Kx8Weight` (`q4x8`'s codes and kernel,
  each block's scale d * sc and min -(dmin * m) computed from the 6-bit sc, m and the
  float16 d, dmin: exact float32 products, so the arithmetic is Q4_1's with float32
  scales, 4.625 bits a weight against the file's 4.5), Q6_K as `Q6Kx8Weight` (codes
  q - 32 one byte each, integer sums per 16 values times their int8 scale in int32, then
  d * dx; 8.5625 bits against 6.5625), Q5_0 as `Q8x8Weight` (codes q - 16, scale d;
  8.5 bits against 5.5), the rest as `q8x8` / `q4x8` hold them. A fused q/k/v or
  gate/up of two kinds is a `StackedWeight`: one kernel call a kind, the outputs
  concatenated. Every served value equals `gguf.quants.dequantize` of the file bit for
  bit (tests/unit/test_kquant.py). The default for such files (`native_format`).

GGUF types no format holds as stored (Q5_K, Q5_1, Q2_K, Q3_K, i-quants, F16 layers) are
dequantized and served as `fp16` by default; asked for, `q4x8` / `q8x8` / `kx8`
re-quantize them from the dequantized floats (not the file's values).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

WEIGHT_FORMATS = ("full", "fp16", "q4", "q4x8", "q8x8", "kx8")
# the formats whose weights are int8-activation blocks (`Q4x8Weight`, `Q8x8Weight`)
INT8_FORMATS = ("q4x8", "q8x8", "kx8")
QBLOCK = 32  # values per block of `q4` / `q8` weights, along the input axis
Q4_SUFFIXES = (".q4_codes", ".q4_scales", ".q4_mins")  # uint8 [N, K/2], f32 [N, K/32] x 2
Q8_SUFFIXES = (".q8_codes", ".q8_scales")  # int8 [N, K], float32 [N, K/32]
# format `q4x8`: the same parts in the 8-row interleaved layout (`Q4x8Weight`, `Q8x8Weight`)
Q4X8_SUFFIXES = (".q4x8_codes", ".q4x8_scales", ".q4x8_mins")
Q8X8_SUFFIXES = (".q8x8_codes", ".q8x8_scales")
# format `kx8`: a GGUF's Q4_K and Q6_K weights as stored (`Q4Kx8Weight`, `Q6Kx8Weight`)
Q4KX8_SUFFIXES = (".q4kx8_codes", ".q4kx8_scales", ".q4kx8_mins", ".q4kx8_d", ".q4kx8_dmin")
Q6KX8_SUFFIXES = (".q6kx8_codes", ".q6kx8_scales", ".q6kx8_d")
# the weights `q4` stores Q8_0-style (embedding lookups need them row by row)
Q8_NAMES = ("model.embed_tokens.weight", "lm_head.weight")
# Calls with at most this many rows run in the q4 kernel; larger ones dequantize the
# weight into a scratch buffer and use F.linear (MKL). Measured on the 2-core AVX2 machine
# (one thread, CPU time, min of 5, 30 layers of the embedded model's four shapes): kernel
# 90.8 ms at 16 rows, dequantize + MKL 89.2 ms at 17; below 16 rows the kernel wins.
Q_KERNEL_MAX_ROWS = 16
# The output layer's q8 kernel up to this many rows; beyond, slabs of rows are dequantized
# with torch ops and multiplied by MKL (55 ms at 17 rows against the kernel's 15 at 16: the
# kernel stays ahead to about 64; only the last rows of many sequences at once get there).
Q8_KERNEL_MAX_ROWS = 64

_FP16_GEMM = None


def _fp16_ops() -> tuple[Callable, Callable]:
    """fbgemm's fp16 prepack and GEMM ops, resolved once. The GEMM is called through the
    overload's C++ entry point (`_op`), which skips a few microseconds of Python argument
    checks per call (121 calls per decode step of the embedded model)."""
    global _FP16_GEMM
    if _FP16_GEMM is None:
        gemm = torch.ops.quantized.linear_dynamic_fp16.default
        _FP16_GEMM = (torch.ops.quantized.linear_prepack_fp16.default,
                      getattr(gemm, "_op", gemm))
    return _FP16_GEMM


def check_weight_format(fmt: str, *, dtype: str, device: str, recipe: str) -> None:
    """Refuse a weight format the serving setup cannot run.

    `q4`, `q4x8` and `q8x8` also need Flare's C++ kernel (`flare.kernels.qgemm`):
    checking builds it once (about a minute on 2 cores; cached on disk after).

    Raises:
        ValueError: unknown format; `fp16`, `q4`, `q4x8` or `q8x8` with a serving dtype
            other than float32, a device other than CPU, or a recipe other than `llama`
            (all named); `q4`/`q4x8`/`q8x8` where the kernel cannot be had (CPU without
            AVX2/FMA, no C++ compiler or ninja, failed build: the reason is in the message).
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {list(WEIGHT_FORMATS)}")
    if fmt in ("fp16", "q4") + INT8_FORMATS:
        kernel = f"Flare's {fmt} kernel"
        why = []
        if dtype != "float32":
            why.append(f"serving dtype {dtype!r} (needs float32 activations)")
        if torch.device(device).type != "cpu":
            why.append(f"device {device!r} ({kernel} runs on CPU)")
        if recipe != "llama":
            why.append(f"recipe {recipe!r} (only 'llama' reads {fmt} weights)")
        if why:
            raise ValueError(f"weight format {fmt!r} does not apply to " + ", ".join(why)
                             + "; use --weights full")
    if fmt in ("q4",) + INT8_FORMATS:
        from flare.kernels import qgemm_problem

        problem = qgemm_problem()  # builds the kernel once (about a minute), then cached
        if problem is not None:
            raise ValueError(f"weight format {fmt!r} is not available on this machine: "
                             f"{problem}; use --weights fp16")


# GGUF tensor types whose values a format holds exactly when it is built from the file's
# blocks (`convert_tensors(..., blocks=)`; norms stay float32):
# - `q4x8` layers: Q4_1 blocks are its own (codes, float16 scale and min); a Q4_0 block
#   (d, codes q, value d * (q - 8)) is the Q4_1 block with scale d and min -8d, the same
#   codes (-8d is exact in float16). Re-quantizing Q4_0's floats as Q4_1 would move a
#   block that does not use both extreme codes, so they are never re-quantized.
# - `q8x8` layers: Q8_0 blocks are its own; a Q4_0 block is the Q8_0 block with scale d
#   and codes q - 8.
# - either format's token embedding and output layer ("other"): Q8_0 kept as Q8_0, Q4_0
#   and Q4_1 as `Q4x8Weight`, F16 / BF16 / F32 as float16 where every value converts
#   exactly, else in the serving dtype (run by the dense kernels).
# - `q8x8` also takes Q5_0 blocks when asked for (codes q - 16, scale d: exact).
# - `kx8` (any mix of these, layers and embedding / output layer alike): Q4_K as
#   `Q4Kx8Weight`, Q6_K as `Q6Kx8Weight`, Q5_0 and Q8_0 as `Q8x8Weight`, Q4_0 / Q4_1 as
#   `Q4x8Weight`; weights of two kinds in one fused
#   projection (a Q4_K_M file's q/k Q4_K beside a Q6_K v) run as `StackedWeight`.
Q4X8_NATIVE_LAYER_TYPES = frozenset({"Q4_0", "Q4_1"})
Q8X8_NATIVE_LAYER_TYPES = frozenset({"Q8_0", "Q4_0"})
NATIVE_OTHER_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0", "F16", "BF16", "F32"})
KX8_NATIVE_LAYER_TYPES = frozenset({"Q4_K", "Q6_K", "Q5_0", "Q8_0", "Q4_0", "Q4_1"})
KX8_NATIVE_OTHER_TYPES = NATIVE_OTHER_TYPES | {"Q4_K", "Q6_K", "Q5_0"}
Q4X8_NATIVE_OTHER_TYPES = NATIVE_OTHER_TYPES  # kept for callers of the older name


def native_format(source: Mapping | None) -> str | None:
    """The int8-activation format that holds a checkpoint's weights as stored, or None.

    `source["weight_types"]` ({"layers": [...], "other": [...]}, GGUF type names, written
    by the GGUF loader) decides: `q4x8` for a GGUF whose layer weights are all Q4_1 or
    Q4_0, `q8x8` for one whose layers are Q8_0 / Q5_0 (Q4_0 beside them allowed), in
    both cases with the embedding / output layer among `NATIVE_OTHER_TYPES`; else `kx8`
    where every layer type is in `KX8_NATIVE_LAYER_TYPES` and every other one in
    `KX8_NATIVE_OTHER_TYPES` (K-quant files such as Q4_K_M and Q6_K, and mixes the two
    formats above do not fuse). Anything else (a safetensors folder, F16, Q5_1, Q5_K or
    other layer types): None."""
    if not source or source.get("format") != "gguf":
        return None
    types = source.get("weight_types") or {}
    layers, other = set(types.get("layers", ())), set(types.get("other", ()))
    if not layers:
        return None
    if other <= NATIVE_OTHER_TYPES:
        if layers <= Q4X8_NATIVE_LAYER_TYPES:
            return "q4x8"
        if layers <= Q8X8_NATIVE_LAYER_TYPES:
            return "q8x8"
    if layers <= KX8_NATIVE_LAYER_TYPES and other <= KX8_NATIVE_OTHER_TYPES:
        return "kx8"
    return None


def native_q4x8(source: Mapping | None) -> bool:
    """Whether a checkpoint's weights are stored as `q4x8` holds them (`native_format`):
    a GGUF of Q4_1 / Q4_0 layers."""
    return native_format(source) == "q4x8"


def native_q8x8(source: Mapping | None) -> bool:
    """Whether a checkpoint's weights are stored as `q8x8` holds them (`native_format`):
    a GGUF of Q8_0 layers."""
    return native_format(source) == "q8x8"


def default_weight_format(*, dtype: str, device: str, recipe: str,
                          source: Mapping | None = None) -> str:
    """The fastest exact format for a model (docs/preparation-contract.md, "Exactness").

    - `q4x8` for a GGUF of Q4_1 or Q4_0 layers (the embedded model is Q4_1), `q8x8` for
      one of Q8_0 / Q5_0 layers, `kx8` for K-quant files (Q4_K_M, Q6_K, ...) and other
      mixes of those types (`native_format(source)`), where the format applies (CPU,
      float32, recipe `llama`) and Flare's kernel builds: the file's own blocks, the
      fastest decode and prefill measured;
    - else `fp16` where it applies: half the bytes of `full` per decoded token, run by
      Flare's row-invariant kernel;
    - else `full`.

    Every one of them is batch- and chunk-invariant on CPU with Flare's kernels.
    `source` is the checkpoint's (or a package manifest's) source identity; None or a
    safetensors folder never picks `q4x8` or `q8x8`.
    """
    native = native_format(source)
    if native is not None:
        try:
            check_weight_format(native, dtype=dtype, device=device, recipe=recipe)
        except ValueError:
            pass
        else:
            return native
    try:
        check_weight_format("fp16", dtype=dtype, device=device, recipe=recipe)
    except ValueError:
        return "full"
    return "fp16"


def _is_stored_low(name: str, t: torch.Tensor) -> bool:
    # the 2-D weights: projections, embedding, output layer (norms and biases are 1-D)
    return t.dim() == 2 and name.endswith(".weight")


FP16_MAX = 65504.0  # largest finite float16


def fp16_overflow(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """The first 2-D weight with a value beyond float16's finite range (it would become
    infinite), or None. Weights trained in bfloat16 or float32 are far inside it, and
    bfloat16 values of normal magnitude convert to float16 exactly."""
    for name, t in tensors.items():
        if _is_stored_low(name, t) and t.is_floating_point() and (
                float(t.abs().max()) > FP16_MAX):
            return name
    return None


# ---- q4 / q8 block quantization --------------------------------------------------------

@dataclass(frozen=True)
class Q4Weight:
    """A weight [N, K] in `q4` blocks: value[n, 32 b + j] = scales[n, b] * code + mins[n, b].

    Attributes:
        codes: uint8 [N, K/2]; per block 16 bytes, byte j holding element j's code in its
            low nibble and element j + 16's in its high nibble.
        scales: float32 [N, K/32], the blocks' d.
        mins: float32 [N, K/32], the blocks' m.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.mins.nbytes

    def parts(self) -> tuple[torch.Tensor, ...]:
        """(codes, scales, mins), in `Q4_SUFFIXES` order."""
        return self.codes, self.scales, self.mins

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: d * q + m, rounded after the product and after the sum."""
        n = self.codes.shape[0]
        c = self.codes.view(n, -1, QBLOCK // 2)
        q = torch.cat([c & 0xF, c >> 4], dim=-1).float()  # [N, K/32, 32]
        return (q * self.scales.unsqueeze(-1) + self.mins.unsqueeze(-1)).view(n, -1)


@dataclass(frozen=True)
class Q8Weight:
    """A weight [N, K] in Q8_0-style blocks: value[n, 32 b + j] = scales[n, b] * codes[n, 32 b + j].

    Attributes:
        codes: int8 [N, K], in -127..127.
        scales: float32 [N, K/32].

    Indexing with row ids (`w[ids]`, ids int64 [T]) returns those rows dequantized,
    float32 [T, K] (the product d * q, exact as float32 rounds it): the embedding lookup.
    """

    codes: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes

    def parts(self) -> tuple[torch.Tensor, ...]:
        """(codes, scales), in `Q8_SUFFIXES` order."""
        return self.codes, self.scales

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        codes, scales = self.codes[rows], self.scales[rows]
        t = codes.shape[0]
        return (codes.view(t, -1, QBLOCK).float() * scales.unsqueeze(-1)).view(t, -1)

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """float32 [stop - start, K] of rows start..stop (default all)."""
        return self[slice(start, stop)]


def _blocks(w: torch.Tensor, name: str = "weight") -> torch.Tensor:
    if w.dim() != 2 or w.shape[1] % QBLOCK:
        raise ValueError(f"{name} has shape {tuple(w.shape)}: q4/q8 need a 2-D weight whose "
                         f"input axis is a multiple of {QBLOCK}")
    return w.detach().float().reshape(w.shape[0], -1, QBLOCK)


def quantize_q4(w: torch.Tensor, name: str = "weight") -> Q4Weight:
    """Q4_1's quantizer on a weight [N, K] (K a multiple of 32, any float dtype).

    Per block of 32 along K: m = block min, d = (max - min) / 15, q = round((x - m) / d)
    clamped to 0..15 (a constant block has d = 0 and q = 0). Computed in float32.
    Re-quantizing weights dequantized from Q4_1 (whose blocks span codes 0 and 15, as
    Q4_1's reference quantizer makes them) gives back the same codes, and d, m within
    float32 rounding.

    Raises:
        ValueError: w not 2-D or K not a multiple of 32 (naming `name`).
    """
    b = _blocks(w, name)
    lo, hi = b.amin(-1), b.amax(-1)
    d = (hi - lo) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d)).unsqueeze(-1)
    q = ((b - lo.unsqueeze(-1)) / safe).round_().clamp_(0, 15)
    q = torch.where(d.unsqueeze(-1) > 0, q, torch.zeros_like(q)).to(torch.uint8)
    codes = q[..., :QBLOCK // 2] | (q[..., QBLOCK // 2:] << 4)
    return Q4Weight(codes.reshape(w.shape[0], -1).contiguous(), d.contiguous(),
                    lo.contiguous())


def quantize_q8(w: torch.Tensor, name: str = "weight") -> Q8Weight:
    """Q8_0's quantizer on a weight [N, K] (K a multiple of 32): per block of 32 along K,
    d = amax / 127 and q = round(x / d) in -127..127 (an all-zero block has d = 0, q = 0).

    Raises:
        ValueError: w not 2-D or K not a multiple of 32 (naming `name`).
    """
    b = _blocks(w, name)
    d = b.abs().amax(-1) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d)).unsqueeze(-1)
    q = (b / safe).round_().clamp_(-127, 127)
    q = torch.where(d.unsqueeze(-1) > 0, q, torch.zeros_like(q)).to(torch.int8)
    return Q8Weight(q.reshape(w.shape[0], -1).contiguous(), d.contiguous())


# ---- q4x8: the same blocks, 8 rows interleaved ----------------------------------------
#
# Rows 8g..8g+7 of a weight form group g. Per group and block, q4 codes are 4 chunks of
# 32 bytes and q8 codes 8 chunks: chunk c holds, for each row i of the group, the row's
# block bytes 4c..4c+3 at bytes 4i..4i+3; scales and mins are float16 [block, row] (a
# GGUF's own precision: 20 bytes a q4 block instead of 24, 34 a q8 one). One load then
# feeds 8 output rows (see kernels/qdot8.cpp). As tensors the parts keep their `q4`/`q8`
# shapes ([N, K/2], [N, K], [N, K/32]); groups are contiguous runs of 8 rows, so fusing
# weights (q/k/v, gate/up) is still a concatenation along the output axis.

def _interleave(t: torch.Tensor, bytes_per_chunk: int) -> torch.Tensor:
    """Rows [N, C] (C = blocks x chunks x `bytes_per_chunk`) into the group layout."""
    n, c = t.shape
    chunks = c // bytes_per_chunk
    return (t.reshape(n // 8, 8, chunks, bytes_per_chunk).permute(0, 2, 1, 3)
            .contiguous().view(n, c))


def _deinterleave(t: torch.Tensor, bytes_per_chunk: int) -> torch.Tensor:
    n, c = t.shape
    chunks = c // bytes_per_chunk
    return (t.reshape(n // 8, chunks, 8, bytes_per_chunk).permute(0, 2, 1, 3)
            .contiguous().view(n, c))


def _check_groups(n: int, name: str) -> None:
    if n % 8:
        raise ValueError(f"weight {name!r} has {n} output rows: weight formats 'q4x8' and "
                         f"'q8x8' need a multiple of 8; use --weights q4 or fp16")


def _half(t: torch.Tensor, name: str) -> torch.Tensor:
    """Block scales or mins as float16. Raises ValueError naming the weight when one is
    beyond float16's range (it would turn infinite)."""
    h = t.half()
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"weight {name!r} has block scales or mins beyond float16's range "
                         f"(+-{FP16_MAX:g}): weight formats 'q4x8' and 'q8x8' store them "
                         f"as float16; use --weights q4")
    return h


@dataclass(frozen=True)
class Q4x8Weight:
    """A `Q4Weight` [N, K] in the 8-row interleaved layout, run with int8 activations.

    Attributes:
        codes: uint8 [N, K/2]; scales, mins: float16 [N, K/32] (see the layout above;
            float16 as in a GGUF's Q4_1 blocks: `pack` rounds float32 ones to nearest).
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @classmethod
    def pack(cls, w: Q4Weight, name: str = "weight") -> "Q4x8Weight":
        """Raises ValueError: N is not a multiple of 8, or a scale or min beyond float16's
        range (naming `name`)."""
        _check_groups(w.codes.shape[0], name)
        return cls(_interleave(w.codes, 4), _interleave(_half(w.scales, name), 1),
                   _interleave(_half(w.mins, name), 1))

    def unpack(self) -> Q4Weight:
        return Q4Weight(_deinterleave(self.codes, 4), _deinterleave(self.scales, 1).float(),
                        _deinterleave(self.mins, 1).float())

    shape = Q4Weight.shape
    nbytes = Q4Weight.nbytes
    parts = Q4Weight.parts

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (int64 [T]) dequantized, float32 [T, K]: an embedding lookup read
        from the interleaved blocks (the token embedding of a Q4_0 / Q4_1 GGUF)."""
        n, half_k = self.codes.shape
        k = half_k * 2
        g, i = rows // 8, rows % 8
        codes = self.codes.view(n // 8, half_k // 4, 8, 4)[g, :, i]  # [T, K/8, 4]
        t = codes.shape[0]
        c = codes.reshape(t, -1, QBLOCK // 2)
        q = torch.cat([c & 0xF, c >> 4], dim=-1).float()  # [T, K/32, 32]
        scales = self.scales.view(n // 8, k // QBLOCK, 8)[g, :, i].float()
        mins = self.mins.view(n // 8, k // QBLOCK, 8)[g, :, i].float()
        return (q * scales.unsqueeze(-1) + mins.unsqueeze(-1)).view(t, k)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], as `Q4Weight.dequantize` of the unpacked blocks."""
        return self.unpack().dequantize()


@dataclass(frozen=True)
class Q8x8Weight:
    """A `Q8Weight` [N, K] in the 8-row interleaved layout, run with int8 activations.

    Indexing with row ids (int64 [T]) returns those rows dequantized, float32 [T, K], as
    `Q8Weight` does (the embedding lookup, read from the interleaved codes).
    """

    codes: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def pack(cls, w: Q8Weight, name: str = "weight") -> "Q8x8Weight":
        """Raises ValueError: N is not a multiple of 8, or a scale beyond float16's range
        (naming `name`)."""
        _check_groups(w.codes.shape[0], name)
        return cls(_interleave(w.codes, 4), _interleave(_half(w.scales, name), 1))

    def unpack(self) -> Q8Weight:
        return Q8Weight(_deinterleave(self.codes, 4), _deinterleave(self.scales, 1).float())

    shape = Q8Weight.shape
    nbytes = Q8Weight.nbytes
    parts = Q8Weight.parts

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        n, k = self.codes.shape
        g, i = rows // 8, rows % 8
        codes = self.codes.view(n // 8, k // 4, 8, 4)[g, :, i]  # [T, K/4, 4]
        scales = self.scales.view(n // 8, k // QBLOCK, 8)[g, :, i].float()  # [T, K/32]
        t = codes.shape[0]
        return (codes.reshape(t, -1, QBLOCK).float() * scales.unsqueeze(-1)).view(t, k)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return self.unpack().dequantize()


def _pick_rows(t: torch.Tensor, rows: torch.Tensor, bytes_per_chunk: int) -> torch.Tensor:
    """Rows `rows` (int64 [T]) of a part in the group layout, un-interleaved: [T, C]."""
    n, c = t.shape
    picked = t.view(n // 8, c // bytes_per_chunk, 8, bytes_per_chunk)[rows // 8, :, rows % 8]
    return picked.reshape(rows.shape[0], c)


def q4_k_values(codes: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor,
                dmin: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of Q4_K parts in row order (`q4_k_from_gguf`'s shapes):
    (d * sc) * q - dmin * m per sub-block of 32, the products d * sc and dmin * m exact in
    float32, then gguf's two roundings (the product with q, the difference)."""
    n = codes.shape[0]
    c = codes.view(n, -1, QBLOCK // 2)
    q = torch.cat([c & 0xF, c >> 4], dim=-1).float()  # [N, K/32, 32]
    scale = d.float().repeat_interleave(8, dim=1) * sc.float()  # [N, K/32]
    low = dmin.float().repeat_interleave(8, dim=1) * m.float()
    return (q * scale.unsqueeze(-1) - low.unsqueeze(-1)).view(n, -1)


def q6_k_values(codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of Q6_K parts in row order (`q6_k_from_gguf`'s shapes):
    (d * sc) * code per 16 values, d * sc exact in float32, one rounding after."""
    n = codes.shape[0]
    scale = d.float().repeat_interleave(16, dim=1) * sc.float()  # [N, K/16]
    return (codes.view(n, -1, 16).float() * scale.unsqueeze(-1)).view(n, -1)


@dataclass(frozen=True)
class Q4Kx8Weight:
    """A GGUF Q4_K weight [N, K] (K a multiple of 256) as stored, in the 8-row interleaved
    layout, run with int8 activations (`q4kx8_linear`, kernels/qdot8.cpp: `q4x8`'s
    kernel, each block's scale d * sc and min -(dmin * m) computed exactly in float32).

    Attributes:
        codes: uint8 [N, K/2], `Q4x8Weight`'s codes layout (per block of 32, byte j holds
            elements j and j + 16).
        scales, mins: uint8 [N, K/32], the 6-bit sub-block sc and m (group layout, one
            byte a chunk).
        d, dmin: float16 [N, K/256], the super-blocks' d and dmin (group layout).

    Value: (d * sc) * code - dmin * m, equal to gguf's dequantization bit for bit.
    Indexing with row ids (int64 [T]) returns those rows dequantized, float32 [T, K].
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    @classmethod
    def of(cls, codes: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor,
           dmin: torch.Tensor, name: str = "weight") -> "Q4Kx8Weight":
        """From row-order parts (`q4_k_from_gguf`). Raises ValueError: N is not a multiple
        of 8 (naming `name`)."""
        _check_groups(codes.shape[0], name)
        return cls(_interleave(codes.contiguous(), 4), _interleave(sc.contiguous(), 1),
                   _interleave(m.contiguous(), 1), _interleave(d.contiguous(), 1),
                   _interleave(dmin.contiguous(), 1))

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts())

    def parts(self) -> tuple[torch.Tensor, ...]:
        """(codes, scales, mins, d, dmin), in `Q4KX8_SUFFIXES` order."""
        return self.codes, self.scales, self.mins, self.d, self.dmin

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        return q4_k_values(_pick_rows(self.codes, rows, 4), _pick_rows(self.scales, rows, 1),
                           _pick_rows(self.mins, rows, 1), _pick_rows(self.d, rows, 1),
                           _pick_rows(self.dmin, rows, 1))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return q4_k_values(_deinterleave(self.codes, 4), _deinterleave(self.scales, 1),
                           _deinterleave(self.mins, 1), _deinterleave(self.d, 1),
                           _deinterleave(self.dmin, 1))


@dataclass(frozen=True)
class Q6Kx8Weight:
    """A GGUF Q6_K weight [N, K] (K a multiple of 256) as stored, in the 8-row interleaved
    layout, run with int8 activations (`q6kx8_linear`, kernels/qdot8.cpp).

    Attributes:
        codes: int8 [N, K], q - 32 in -32..31, `Q8x8Weight`'s codes layout (one byte a
            value: 8 bits held for Q6_K's 6, so the kernel reads them with one load).
        scales: int8 [N, K/16], the sub-block scales (group layout).
        d: float16 [N, K/256], the super-blocks' d (group layout).

    Value: (d * sc) * code, equal to gguf's dequantization bit for bit. Indexing with row
    ids (int64 [T]) returns those rows dequantized, float32 [T, K].
    """

    codes: torch.Tensor
    scales: torch.Tensor
    d: torch.Tensor

    @classmethod
    def of(cls, codes: torch.Tensor, sc: torch.Tensor, d: torch.Tensor,
           name: str = "weight") -> "Q6Kx8Weight":
        """From row-order parts (`q6_k_from_gguf`). Raises ValueError: N is not a multiple
        of 8 (naming `name`)."""
        _check_groups(codes.shape[0], name)
        return cls(_interleave(codes.contiguous(), 4), _interleave(sc.contiguous(), 1),
                   _interleave(d.contiguous(), 1))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts())

    def parts(self) -> tuple[torch.Tensor, ...]:
        """(codes, scales, d), in `Q6KX8_SUFFIXES` order."""
        return self.codes, self.scales, self.d

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        return q6_k_values(_pick_rows(self.codes, rows, 4), _pick_rows(self.scales, rows, 1),
                           _pick_rows(self.d, rows, 1))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return q6_k_values(_deinterleave(self.codes, 4), _deinterleave(self.scales, 1),
                           _deinterleave(self.d, 1))


@dataclass(frozen=True)
class StackedWeight:
    """Weights [N_i, K] of different kinds stacked along the output axis (a fused q/k/v
    whose parts a GGUF stores in two types, as Q4_K_M files do): `Linear` runs each part
    in its own kernel and concatenates the outputs, so each output row is what the part
    alone gives (row invariance kept).

    Attributes:
        parts_: the weights, in output order (adjacent ones of one kind already fused).
    """

    parts_: tuple

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts_), self.parts_[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts_)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return torch.cat([p.dequantize() if hasattr(p, "dequantize") else p.float()
                          for p in self.parts_])


QuantizedWeight = Q4Weight | Q8Weight | Q4x8Weight | Q8x8Weight | Q4Kx8Weight | Q6Kx8Weight
_BLOCK_KINDS = (Q4Weight, Q8Weight, Q4x8Weight, Q8x8Weight, Q4Kx8Weight, Q6Kx8Weight)
# the kinds a `StackedWeight` may hold (the int8-activation ones)
_INT8_KINDS = _BLOCK_KINDS[2:]


# ---- a GGUF's own blocks -----------------------------------------------------------------
#
# ggml's block layouts (32 values a block, little-endian float16 d and m):
#   Q4_0: d, 16 bytes of codes          value = d * (q - 8)
#   Q4_1: d, m, 16 bytes of codes       value = d * q + m
#   Q8_0: d, 32 int8 codes              value = d * q
#   Q5_0: d, 4 bytes qh, 16 bytes qs   value = d * (q - 16), q = nibble | bit j of qh << 4
# and the K-quants' super-blocks of 256 (gguf.quants documents the layouts):
#   Q4_K: d, dmin, 12 bytes of 6-bit sub-block scales sc and mins m (8 of each), 128 bytes
#         of codes (4 runs of 32 bytes: low nibbles sub-block 2r, high ones 2r + 1);
#         value = (d * sc) * q - dmin * m
#   Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales (one per 16
#         values), d;  value = (d * sc) * (q - 32)
# where code byte j holds element j in its low nibble and element j + 16 in its high one:
# the byte order of `Q4Weight.codes`, so the codes are copied as they are.
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210}
GGUF_BLOCK_VALUES = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q5_0": 32, "Q4_K": 256,
                     "Q6_K": 256}  # values per block along K
GGUF_FLOAT_TYPES = frozenset({"F16", "BF16", "F32"})


@dataclass(frozen=True)
class GGUFBlocks:
    """One 2-D GGUF weight as the file stores it.

    Attributes:
        kind: the GGUF type name ("Q4_0", "Q8_0", "F16", "Q6_K", ...).
        data: for the types of `GGUF_BLOCK_BYTES`, the file's block bytes, uint8
            [rows, K / block values * block bytes] (`GGUF_BLOCK_VALUES`), rows in
            Hugging Face order; else None.
    """

    kind: str
    data: torch.Tensor | None = None


def _block_fields(b: GGUFBlocks) -> torch.Tensor:
    """The blocks as uint8 [N, K / block values, block bytes]."""
    size = GGUF_BLOCK_BYTES[b.kind]
    return b.data.reshape(b.data.shape[0], -1, size)


def _fp16_field(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """float16 [N, K/32] read from bytes at..at+1 of each block."""
    n, nb, _ = blocks.shape
    return blocks[..., at:at + 2].contiguous().view(torch.float16).view(n, nb)


def q4_from_gguf(b: GGUFBlocks, name: str = "weight") -> tuple[torch.Tensor, ...]:
    """(codes uint8 [N, K/2], scales, mins float16 [N, K/32]) of a Q4_0 or Q4_1 weight,
    the file's own values: Q4_1's d, m and codes; for Q4_0 its d, min -8d (exact in
    float16: a power-of-two multiple) and its codes.

    Raises:
        ValueError: another type, or a Q4_0 scale whose -8d overflows float16 (naming
            `name`).
    """
    blocks = _block_fields(b)
    n = blocks.shape[0]
    d = _fp16_field(blocks, 0)
    if b.kind == "Q4_1":
        return blocks[..., 4:].reshape(n, -1), d, _fp16_field(blocks, 2)
    if b.kind != "Q4_0":
        raise ValueError(f"weight {name!r} is {b.kind}, not Q4_0 or Q4_1")
    m = (d.float() * -8).half()
    if not bool(torch.isfinite(m).all()):
        raise ValueError(f"weight {name!r} has Q4_0 scales whose min -8d is beyond "
                         f"float16's range; use --weights fp16")
    return blocks[..., 2:].reshape(n, -1), d, m


def q8_from_gguf(b: GGUFBlocks, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [N, K], scales float16 [N, K/32]) of a Q8_0 or Q4_0 weight, the file's
    own values: Q8_0's d and codes; for Q4_0 its d and codes q - 8 (in -8..7).

    Raises:
        ValueError: another type (naming `name`).
    """
    blocks = _block_fields(b)
    n = blocks.shape[0]
    d = _fp16_field(blocks, 0)
    if b.kind == "Q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1), d
    if b.kind != "Q4_0":
        raise ValueError(f"weight {name!r} is {b.kind}, not Q8_0 or Q4_0")
    c = blocks[..., 2:]
    q = torch.cat([c & 0xF, c >> 4], dim=-1).to(torch.int8) - 8  # [N, K/32, 32]
    return q.reshape(n, -1), d


def q5_0_from_gguf(b: GGUFBlocks, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [N, K] = q - 16 in -16..15, scales float16 [N, K/32]) of a Q5_0 weight:
    the file's d and codes, so value = d * code exactly as gguf dequantizes it.

    Raises:
        ValueError: another type (naming `name`).
    """
    if b.kind != "Q5_0":
        raise ValueError(f"weight {name!r} is {b.kind}, not Q5_0")
    blocks = _block_fields(b)
    n = blocks.shape[0]
    d = _fp16_field(blocks, 0)
    qh = blocks[..., 2:6].to(torch.int64)  # little-endian: bit j of the 32 is element j
    bits = torch.arange(32)
    high = (qh[..., bits // 8] >> (bits % 8)) & 1  # [N, nb, 32]
    c = blocks[..., 6:]
    low = torch.cat([c & 0xF, c >> 4], dim=-1).to(torch.int64)
    q = (low | (high << 4)) - 16
    return q.to(torch.int8).reshape(n, -1), d


def _q4_k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins of Q4_K's 12 packed bytes: uint8 [..., 12] ->
    (sc, m) uint8 [..., 8]. Bytes 0-3 hold sc 0-3 (low 6 bits) and the top bits of sc 4-7,
    bytes 4-7 the same for the mins, bytes 8-11 the low 4 bits of sc 4-7 (low nibble) and
    of m 4-7 (high nibble)."""
    ds, ms, both = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([ds & 0x3F, (both & 0x0F) | ((ds >> 2) & 0x30)], dim=-1)
    m = torch.cat([ms & 0x3F, (both >> 4) | ((ms >> 2) & 0x30)], dim=-1)
    return sc, m


def q4_k_from_gguf(b: GGUFBlocks, name: str = "weight") -> tuple[torch.Tensor, ...]:
    """(codes uint8 [N, K/2] in `Q4Weight`'s byte order, sc uint8 [N, K/32], m uint8
    [N, K/32], d float16 [N, K/256], dmin float16 [N, K/256]) of a Q4_K weight, the file's
    own values: value = (d * sc) * code - dmin * m, as gguf dequantizes it.

    Raises:
        ValueError: another type (naming `name`).
    """
    if b.kind != "Q4_K":
        raise ValueError(f"weight {name!r} is {b.kind}, not Q4_K")
    blocks = _block_fields(b)
    n, ns, _ = blocks.shape
    d, dmin = _fp16_field(blocks, 0), _fp16_field(blocks, 2)
    sc, m = _q4_k_scales(blocks[..., 4:16])
    runs = blocks[..., 16:].reshape(n, ns, 4, 32)
    q = torch.stack([runs & 0xF, runs >> 4], dim=3).reshape(n, ns * 8, 32)  # sub-blocks
    codes = q[..., :16] | (q[..., 16:] << 4)  # byte j: element j low, j + 16 high
    return (codes.reshape(n, -1).contiguous(), sc.reshape(n, -1).contiguous(),
            m.reshape(n, -1).contiguous(), d, dmin)


def q6_k_from_gguf(b: GGUFBlocks, name: str = "weight") -> tuple[torch.Tensor, ...]:
    """(codes int8 [N, K] = q - 32 in -32..31, scales int8 [N, K/16], d float16
    [N, K/256]) of a Q6_K weight, the file's own values: value = (d * sc) * code, as gguf
    dequantizes it.

    Raises:
        ValueError: another type (naming `name`).
    """
    if b.kind != "Q6_K":
        raise ValueError(f"weight {name!r} is {b.kind}, not Q6_K")
    blocks = _block_fields(b)
    n, ns, _ = blocks.shape
    # each half of 128 values: 64 bytes of low nibbles (values 0-63 low, 64-127 high)
    # and 32 bytes of 2-bit pairs (bits 2s..2s+1 of byte j: value 32 s + j)
    ql = blocks[..., 0:128].reshape(n, ns, 2, 1, 64)
    low = torch.cat([ql & 0xF, ql >> 4], dim=3).reshape(n, ns, 2, 4, 32)
    qh = blocks[..., 128:192].reshape(n, ns, 2, 1, 32)
    high = (qh >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 1, 4, 1)) & 3
    q = (low | (high << 4)).to(torch.int8) - 32  # [N, ns, 2, 4, 32] = 256 values in order
    scales = blocks[..., 192:208].contiguous().view(torch.int8).reshape(n, -1)
    d = blocks[..., 208:210].contiguous().view(torch.float16).view(n, ns)
    return q.reshape(n, -1).contiguous(), scales, d


def _q4x8_of(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
             name: str) -> Q4x8Weight:
    _check_groups(codes.shape[0], name)
    return Q4x8Weight(_interleave(codes.contiguous(), 4), _interleave(scales, 1),
                      _interleave(mins, 1))


def _q8x8_of(codes: torch.Tensor, scales: torch.Tensor, name: str) -> Q8x8Weight:
    _check_groups(codes.shape[0], name)
    return Q8x8Weight(_interleave(codes.contiguous(), 4), _interleave(scales, 1))


def native_weight(name: str, b: GGUFBlocks, fmt: str, value: torch.Tensor
                  ) -> QuantizedWeight | torch.Tensor | None:
    """A 2-D weight of format `fmt` (`q4x8`, `q8x8` or `kx8`) built from the file's own
    blocks or values, or None where `fmt` cannot hold them exactly (the caller
    re-quantizes).

    Layers: `q4x8` takes Q4_1 and Q4_0 blocks (`q4_from_gguf`), `q8x8` Q8_0, Q5_0 and Q4_0
    (`q8_from_gguf`, `q5_0_from_gguf`). The token embedding and output layer
    (`Q8_NAMES`), in any of them: Q8_0 as `Q8x8Weight`, Q4_0 / Q4_1 as `Q4x8Weight`, F16 /
    BF16 / F32 as the float tensor `value` (float16 where every value converts exactly,
    else as given). `kx8`, layers and the rest alike: Q4_K as `Q4Kx8Weight`, Q6_K as
    `Q6Kx8Weight`, Q5_0 and Q8_0 as `Q8x8Weight`, Q4_0 / Q4_1 as `Q4x8Weight`.
    """
    other = name in Q8_NAMES or fmt == "kx8"  # kx8 holds every listed type anywhere
    if b.data is not None and fmt == "kx8":
        if b.kind == "Q4_K":
            return Q4Kx8Weight.of(*q4_k_from_gguf(b, name), name=name)
        if b.kind == "Q6_K":
            return Q6Kx8Weight.of(*q6_k_from_gguf(b, name), name=name)
    if b.data is not None and b.kind == "Q5_0" and (other or fmt == "q8x8"):
        return _q8x8_of(*q5_0_from_gguf(b, name), name)
    if b.kind in GGUF_FLOAT_TYPES:
        if name not in Q8_NAMES:
            return None
        half = value.half()
        return half if torch.equal(half.to(value.dtype), value) else value
    if b.data is None:
        return None
    if b.kind == "Q8_0" and (other or fmt == "q8x8"):
        return _q8x8_of(*q8_from_gguf(b, name), name)
    if b.kind == "Q4_0" and fmt == "q8x8" and not other:
        return _q8x8_of(*q8_from_gguf(b, name), name)
    if b.kind in ("Q4_0", "Q4_1") and (other or fmt == "q4x8"):
        return _q4x8_of(*q4_from_gguf(b, name), name)
    return None
_SUFFIXES = ((Q4_SUFFIXES, Q4Weight), (Q8_SUFFIXES, Q8Weight), (Q4X8_SUFFIXES, Q4x8Weight),
             (Q8X8_SUFFIXES, Q8x8Weight), (Q4KX8_SUFFIXES, Q4Kx8Weight),
             (Q6KX8_SUFFIXES, Q6Kx8Weight))


_KX8_SUFFIXES = {Q4Kx8Weight: Q4KX8_SUFFIXES, Q6Kx8Weight: Q6KX8_SUFFIXES}


def weight_getter(tensors: Mapping[str, torch.Tensor]
                  ) -> Callable[[str], torch.Tensor | QuantizedWeight]:
    """`get(name)` over stored tensors: the tensor itself, or the quantized weight
    assembled from `name` + its kind's suffixes where the weight is stored in parts
    (`Q4Weight`, `Q8Weight` for format `q4`; `Q4x8Weight`, `Q8x8Weight` for `q4x8`). The names are listed once (a package mapping reads a tensor per
    access, so membership is never tested by reading).

    Raises (from get):
        ValueError: neither the tensor nor its parts are there, naming it.
    """
    names = set(tensors)

    def get(name: str) -> torch.Tensor | QuantizedWeight:
        if name in names:
            return tensors[name]
        for suffixes, kind in _SUFFIXES:
            if name + suffixes[0] in names:
                return kind(*(tensors[name + sfx] for sfx in suffixes))
        raise ValueError(f"weights lack tensor {name!r}")

    return get


def cat_weights(weights: list[torch.Tensor | QuantizedWeight]
                ) -> torch.Tensor | QuantizedWeight:
    """Weights [N_i, K] of one kind stacked along the output axis (fused q/k/v, gate/up).

    Weights of several int8-activation kinds (`Q4x8Weight`, `Q8x8Weight`, `Q4Kx8Weight`,
    `Q6Kx8Weight`: a GGUF that stores q/k and v in two types) give a `StackedWeight` of
    the runs of one kind, each fused.

    Raises:
        ValueError: the weights mix kinds otherwise (tensor, q4, q8 or an int8 kind).
    """
    if len(weights) == 1:
        return weights[0]
    kinds = {type(w) for w in weights}
    if len(kinds) != 1:
        if not all(k in _INT8_KINDS for k in kinds):
            raise ValueError(f"cannot fuse weights stored as "
                             f"{sorted(k.__name__ for k in kinds)}")
        runs: list[list] = []
        for w in weights:
            if runs and type(runs[-1][0]) is type(w):
                runs[-1].append(w)
            else:
                runs.append([w])
        return StackedWeight(tuple(cat_weights(r) for r in runs))
    kind = kinds.pop()
    if kind in _BLOCK_KINDS:  # groups stack as rows
        return kind(*(torch.cat(p) for p in zip(*(w.parts() for w in weights))))
    return torch.cat(weights)


def convert_tensors(tensors: Mapping[str, torch.Tensor], fmt: str,
                    blocks: Mapping[str, GGUFBlocks] | None = None) -> dict[str, torch.Tensor]:
    """The tensors a package of format `fmt` stores: `full` returns them as they are;
    `fp16` casts every 2-D `*.weight` to float16 (round to nearest even), same names;
    `q4` replaces every 2-D `*.weight` by its parts (`quantize_q4`, or `quantize_q8` for
    the `Q8_NAMES`), stored as `name` + `Q4_SUFFIXES` / `Q8_SUFFIXES`; `q4x8` stores the
    same blocks in the 8-row interleaved layout (`Q4x8Weight.pack`, `Q8x8Weight.pack`)
    under `Q4X8_SUFFIXES` / `Q8X8_SUFFIXES`; `q8x8` stores every 2-D weight as
    `Q8x8Weight` (`quantize_q8`); `kx8` stores a GGUF's blocks as they are (`Q4Kx8Weight`
    under `Q4KX8_SUFFIXES`, `Q6Kx8Weight` under `Q6KX8_SUFFIXES`, the others as `q8x8` /
    `q4x8` store them) and re-quantizes any other weight as `q8x8` does. 1-D tensors
    (norms, biases) are kept as they are.

    `blocks` (a GGUF checkpoint's `Checkpoint.blocks`): for `q4x8`, `q8x8` and `kx8`, each weight
    the format can hold as the file stores it is built from the file's own blocks or
    values (`native_weight`: exact, never re-quantized); the rest is re-quantized from
    `tensors` as above.

    Raises:
        ValueError: unknown format; for `fp16` a weight beyond float16's range; for `q4`,
            `q4x8` and `q8x8` a weight whose input axis is not a multiple of 32, for
            `q4x8` and `q8x8` one whose output axis is not a multiple of 8 (each named).
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {list(WEIGHT_FORMATS)}")
    if fmt == "full":
        return dict(tensors)
    if fmt in ("q4",) + INT8_FORMATS:
        blocks = blocks or {}
        out: dict[str, torch.Tensor] = {}
        for k, v in tensors.items():
            if not _is_stored_low(k, v):
                out[k] = v
                continue
            if v.shape[1] % QBLOCK:
                raise ValueError(f"weight {k!r} has shape {tuple(v.shape)}: weight format "
                                 f"{fmt!r} needs an input axis that is a multiple of "
                                 f"{QBLOCK}; use --weights fp16")
            w = None
            if fmt in INT8_FORMATS and k in blocks:
                w = native_weight(k, blocks[k], fmt, v)
                if isinstance(w, torch.Tensor):  # a float embedding / output layer
                    out[k] = w
                    continue
            q8 = k in Q8_NAMES or fmt in ("q8x8", "kx8")
            if w is None:
                w = (quantize_q8 if q8 else quantize_q4)(v, k)
                if fmt in INT8_FORMATS:
                    w = (Q8x8Weight if q8 else Q4x8Weight).pack(w, k)
            if isinstance(w, (Q4Kx8Weight, Q6Kx8Weight)):
                suffixes = _KX8_SUFFIXES[type(w)]
            elif isinstance(w, Q4x8Weight):
                suffixes = Q4X8_SUFFIXES
            elif isinstance(w, Q8x8Weight):
                suffixes = Q8X8_SUFFIXES
            else:
                suffixes = Q8_SUFFIXES if q8 else Q4_SUFFIXES
            out.update(zip((k + sfx for sfx in suffixes), w.parts()))
        return out
    bad = fp16_overflow(tensors)
    if bad is not None:
        raise ValueError(f"weight {bad!r} has values beyond float16's range "
                         f"(+-{FP16_MAX:g}); use weight format 'full'")
    return {k: v.to(torch.float16) if _is_stored_low(k, v) else v for k, v in tensors.items()}


def dense_panel_bytes(out_features: int, in_features: int, element_size: int) -> int:
    """Bytes of one weight in Flare's dense panel layout ([ceil(out/16), in, 16] of
    `element_size`-byte values: the output axis padded to a multiple of 16)."""
    return -(-out_features // 16) * 16 * in_features * element_size


def fp16_packed_bytes(out_features: int, in_features: int) -> int:
    """Bytes of one float16 weight as `fp16` serves it on CPU with Flare's kernels: the
    panel layout of `dense_panel_bytes` (float16, output axis padded to 16)."""
    return dense_panel_bytes(out_features, in_features, 2)


def fbgemm_fp16_packed_bytes(out_features: int, in_features: int) -> int:
    """Bytes of one weight in fbgemm's packed fp16 layout (the fallback where Flare's
    kernels cannot be had): float16, with the input axis padded to a multiple of 512
    (fbgemm's row block; torch packs with its default) and the output axis to a multiple
    of 16. For the embedded model's 576-wide inputs that is 1024 rows."""
    return -(-in_features // 512) * 512 * -(-out_features // 16) * 16 * 2


_DENSE: ModuleType | None | bool = False  # False: not looked up yet


def dense_kernels() -> ModuleType | None:
    """Flare's kernel module when its row-invariant dense GEMMs (`dense_pack`,
    `f16_linear`, `f32_linear`) can run here, else None (`KernelUnavailable`: the CPU,
    compiler or build; looked up once per process, building the module on first use)."""
    global _DENSE
    if _DENSE is False:
        from flare.kernels import KernelUnavailable, qgemm

        try:
            _DENSE = qgemm()
        except KernelUnavailable:
            _DENSE = None
    return _DENSE


def serving_weight_bytes(tensors: Mapping[str, torch.Tensor], fmt: str,
                         tied_embeddings: bool, *, device: str = "cpu",
                         kernels: bool | None = None) -> int:
    """Bytes of weights a served dense model holds for `tensors` stored in format `fmt`.

    `q4`, `q4x8` and `q8x8`: the stored bytes (fused q/k/v and gate/up replace their
    parts; a float embedding / output layer of a GGUF's `q4x8` / `q8x8` counts as
    `fp16` / `full` count it; with `q4` a tied output layer runs on the embedding's own
    q8 blocks; the float32 scratch
    buffer prefill dequantizes into, the largest layer weight's size per thread, is not
    counted). `fp16` and float32 `full` on CPU with Flare's kernels: each 2-D weight in
    the panel layout (`dense_panel_bytes`), the token embedding as stored for lookups
    plus, with tied embeddings, a panel copy of it for the output layer. `fp16` without
    the kernels: fbgemm's packed layout (`fbgemm_fp16_packed_bytes`) in the same way.
    `full` otherwise (another dtype or device, or no kernels): the stored bytes (a tied
    output layer shares the table). 1-D tensors as stored. Padding is counted per stored
    weight (fused parts whose row counts are multiples of 16 pad alike).

    Args:
        device: the serving device ("cpu", "cuda", ...); only CPU packs.
        kernels: whether Flare's dense kernels run; None looks it up (`dense_kernels`).
    """
    on_cpu = torch.device(device).type == "cpu"
    if fmt not in ("full", "fp16"):
        floats = [n for n, t in tensors.items() if _is_stored_low(n, t)]
        if not floats:  # every 2-D weight in blocks
            return sum(t.numel() * t.element_size() for t in tensors.values())
        # `q4x8` / `q8x8` from a GGUF whose embedding / output layer is float: those are
        # packed like `fp16` / `full` ones, the rest counted as stored
        if kernels is None:
            kernels = on_cpu and dense_kernels() is not None
        total = sum(t.numel() * t.element_size() for n, t in tensors.items()
                    if n not in floats)
        for n in floats:
            t = tensors[n]
            panel = dense_panel_bytes(*t.shape, t.element_size()) if kernels else (
                fbgemm_fp16_packed_bytes(*t.shape) if t.dtype == torch.float16 else 0)
            if n == "model.embed_tokens.weight":
                total += t.numel() * t.element_size() + (panel if tied_embeddings else 0)
            else:
                total += panel or t.numel() * t.element_size()
        return total
    if kernels is None:
        kernels = on_cpu and dense_kernels() is not None
    if fmt == "full":
        if not (on_cpu and kernels):
            return sum(t.numel() * t.element_size() for t in tensors.values())

        def packed(t: torch.Tensor) -> int:
            return dense_panel_bytes(*t.shape, 4)
    elif kernels:
        def packed(t: torch.Tensor) -> int:
            return fp16_packed_bytes(*t.shape)
    else:
        def packed(t: torch.Tensor) -> int:
            return fbgemm_fp16_packed_bytes(*t.shape)
    total = 0
    for name, t in tensors.items():
        if not _is_stored_low(name, t) or (fmt == "full" and t.dtype != torch.float32):
            total += t.numel() * t.element_size()
        elif name == "model.embed_tokens.weight":
            total += t.numel() * t.element_size() + (packed(t) if tied_embeddings else 0)
        else:
            total += packed(t)
    return total


_SCRATCH = threading.local()


def _scratch(numel: int) -> torch.Tensor:
    """A float32 buffer of at least `numel` elements, one per thread, grown as needed:
    prefill dequantizes each q4 weight into it before its F.linear."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


_Q8_CHUNK_ROWS = 4096  # rows of a q8 weight dequantized at a time for a large call


class Linear:
    """y = x W^T (+ b) for one weight, in whichever kernel its storage calls for.

    Args:
        weight: [out, in], in `dtype`, or float16 with `dtype` float32, or a quantized
            weight (`Q4Weight`, `Q8Weight`, `Q4x8Weight`, `Q8x8Weight`, `Q4Kx8Weight`,
            `Q6Kx8Weight`, or a `StackedWeight` of them, one kernel a part) with `dtype`
            float32 on CPU (Flare's kernels; where they cannot be had, dequantized to
            float32 at load with a warning). A float16 or float32 weight under float32
            on CPU is packed into panels for Flare's row-invariant dense kernels
            (`f16_linear`, `f32_linear`; a row's result never depends on the other rows
            of the call); where those cannot be had, float16 runs on fbgemm's fp16 GEMM
            and float32 on `F.linear`. Any other dtype or device: `F.linear` (float16
            widened to float32 at load off the CPU).
        bias: [out] in `dtype`, or None.
        dtype: the serving dtype of activations.

    Call: x [T, in] in `dtype` -> [T, out] in `dtype`.

    Raises:
        ValueError: a weight dtype that is neither `dtype` nor float16 under float32, or
            a q4/q8 weight under another dtype or off the CPU.
    """

    def __init__(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = self.qweight = self.panels = self.stacked = None
        if isinstance(weight, StackedWeight):  # one Linear a kind, outputs concatenated
            self.stacked = [Linear(p, None, dtype) for p in weight.parts_]
            self.weight, self.bias = weight, bias
            self.nbytes = (sum(s.nbytes for s in self.stacked)
                           + (bias.nbytes if bias is not None else 0))
            return
        if isinstance(weight, _BLOCK_KINDS):
            if dtype != torch.float32 or weight.codes.device.type != "cpu":
                raise ValueError(f"q4/q8 weights serve float32 activations on CPU, not "
                                 f"{dtype} on {weight.codes.device}")
            from flare.kernels import KernelUnavailable, qgemm

            try:
                self._kernels = qgemm()
            except KernelUnavailable as exc:
                warnings.warn(f"Flare's q4 kernel is unavailable ({exc}); serving the "
                              f"dequantized float32 weights instead", stacklevel=2)
                weight = weight.dequantize()
            else:
                self.qweight = self.weight = weight
                self.bias = bias
                self.nbytes = weight.nbytes + (bias.nbytes if bias is not None else 0)
                return
        if weight.dtype != dtype and not (weight.dtype == torch.float16
                                          and dtype == torch.float32):
            raise ValueError(f"weight dtype {weight.dtype} cannot serve {dtype} "
                             f"activations (expected {dtype}, or float16 under float32)")
        bias_bytes = bias.nbytes if bias is not None else 0
        if dtype == torch.float32 and weight.device.type == "cpu":
            kernels = dense_kernels()
            if kernels is not None:  # row-invariant panels, float16 or float32
                self.panels = kernels.dense_pack(weight)
                self._dense = (kernels.f16_linear if weight.dtype == torch.float16
                               else kernels.f32_linear)
                self.bias = bias.contiguous() if bias is not None else None
                self.weight = None
                self.nbytes = self.panels.nbytes + bias_bytes
                return
            if weight.dtype == torch.float16:
                prepack, self._gemm = _fp16_ops()
                # fbgemm copies the weight into its own fp16 layout; the float32 widening
                # is exact and only lives for this call
                self.packed = prepack(weight.float(), bias)
                self.nbytes = fbgemm_fp16_packed_bytes(*weight.shape) + bias_bytes
                self.weight = self.bias = None
                return
        weight = weight.to(dtype)
        self.weight, self.bias = weight, bias
        self.nbytes = weight.nbytes + bias_bytes

    def _quantized(self, x: torch.Tensor) -> torch.Tensor:
        w, k = self.qweight, self._kernels
        x = x.contiguous()
        # q4x8: int8 activations at every batch size (the same result for a row whatever
        # the rows beside it), faster than dequantize + MKL even for prompts
        if isinstance(w, Q4x8Weight):
            y = k.q4x8_linear(x, w.codes, w.scales, w.mins)
        elif isinstance(w, Q8x8Weight):
            y = k.q8x8_linear(x, w.codes, w.scales)
        elif isinstance(w, Q4Kx8Weight):
            y = k.q4kx8_linear(x, w.codes, w.scales, w.mins, w.d, w.dmin)
        elif isinstance(w, Q6Kx8Weight):
            y = k.q6kx8_linear(x, w.codes, w.scales, w.d)

        elif isinstance(w, Q4Weight):
            if x.shape[0] <= Q_KERNEL_MAX_ROWS:
                y = k.q4_linear(x, w.codes, w.scales, w.mins)
            else:
                dense = _scratch(self.out_features * self.in_features).view(
                    self.out_features, self.in_features)
                k.q4_dequantize_into(w.codes, w.scales, w.mins, dense)
                return F.linear(x, dense, self.bias)
        elif x.shape[0] <= Q8_KERNEL_MAX_ROWS:
            y = k.q8_linear(x, w.codes, w.scales)
        else:  # many rows through the output layer: dequantize a slab of rows at a time
            y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
            for a in range(0, self.out_features, _Q8_CHUNK_ROWS):
                b = min(a + _Q8_CHUNK_ROWS, self.out_features)
                y[:, a:b] = F.linear(x, w.dequantize(a, b))
        return y if self.bias is None else y.add_(self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return self._dense(x.contiguous(), self.panels, self.out_features, self.bias)
        if self.packed is not None:
            return self._gemm(x, self.packed)
        if self.qweight is not None:
            return self._quantized(x)
        if self.stacked is not None:
            y = torch.cat([s(x) for s in self.stacked], dim=1)
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x, self.weight, self.bias)
