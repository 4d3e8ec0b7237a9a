"""Weight formats of the linear layers: chosen by `prepare`, stored in the package, run here.

A format says how the 2-D weights of a dense (`llama` recipe) model are stored and
multiplied; activations, norms, biases and the KV cache stay in the serving dtype.

- `full`: every weight in the serving dtype, multiplied with `F.linear` (MKL on CPU).
- `fp16`: the 2-D weights (q/k/v/o, gate/up/down, token embedding, output layer) stored
  as float16 (round to nearest even), for a float32 serving dtype. On CPU they are
  multiplied by fbgemm's fp16 GEMM (`quantized::linear_dynamic_fp16`): fbgemm packs them
  at load into its own float16 layout and widens them to float32 in registers, with
  float32 accumulation. So the result is a float32 product with the float16-rounded
  weights: what transformers computes on the same weights upcast to float32, up to
  summation order. Decode reads half the bytes of `full`. The token embedding is looked
  up from its float16 table and widened exactly. On other devices the weights are
  widened to the serving dtype at load (no speed gain, same values).

Measured on the 2-core AVX2 machine of FACTS.md, one thread, thread CPU time, one layer's
four matmuls of the embedded model with 30 layers' weights streamed from memory (one run
on a shared machine; medians of 5): fp32 1.22 ms at 1 token, 2.82 ms at 8, 50.8 ms at
512; fp16 0.78 / 1.37 / 46.3 ms. PyTorch's weight-only int8 and int4 CPU kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) have no AVX2 path in torch 2.13:
5.2 ms at 1 token (4x slower than fp32), 52.6 ms at 8, 3.2 s at 512 (int4 slower still);
`torch._int_mm` is slower again. They are not offered as formats.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

WEIGHT_FORMATS = ("full", "fp16")

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

    Raises:
        ValueError: unknown format, or `fp16` with a serving dtype other than float32, a
            device other than CPU, or a recipe other than `llama` (all named).
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {list(WEIGHT_FORMATS)}")
    if fmt == "fp16":
        why = []
        if dtype != "float32":
            why.append(f"serving dtype {dtype!r} (needs float32 activations)")
        if torch.device(device).type != "cpu":
            why.append(f"device {device!r} (fbgemm runs on CPU)")
        if recipe != "llama":
            why.append(f"recipe {recipe!r} (only 'llama' reads fp16 weights)")
        if why:
            raise ValueError("weight format 'fp16' does not apply to " + ", ".join(why)
                             + "; use --weights full")


def default_weight_format(*, dtype: str, device: str, recipe: str) -> str:
    """`fp16` where it applies (CPU, float32 serving dtype, recipe `llama`): it reads half
    the bytes per decoded token and is no slower at any batch size measured; else `full`."""
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


def convert_tensors(tensors: Mapping[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """The tensors a package of format `fmt` stores, same names: `full` returns them as
    they are; `fp16` casts every 2-D `*.weight` to float16 (round to nearest even).

    Raises:
        ValueError: unknown format, or for `fp16` a weight beyond float16's range (named).
    """
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {list(WEIGHT_FORMATS)}")
    if fmt == "full":
        return dict(tensors)
    bad = fp16_overflow(tensors)
    if bad is not None:
        raise ValueError(f"weight {bad!r} has values beyond float16's range "
                         f"(+-{FP16_MAX:g}); use weight format 'full'")
    return {k: v.to(torch.float16) if _is_stored_low(k, v) else v for k, v in tensors.items()}


def fp16_packed_bytes(out_features: int, in_features: int) -> int:
    """Bytes of one weight in fbgemm's packed fp16 layout: float16, with the input axis
    padded to a multiple of 512 (fbgemm's row block; torch packs with its default) and
    the output axis to a multiple of 16. For the embedded model's 576-wide inputs that is
    1024 rows: the padding costs memory, not bandwidth (the kernel skips it)."""
    return -(-in_features // 512) * 512 * -(-out_features // 16) * 16 * 2


def serving_weight_bytes(tensors: Mapping[str, torch.Tensor], fmt: str,
                         tied_embeddings: bool) -> int:
    """Bytes of weights a served dense model holds for `tensors` stored in format `fmt`.

    `full`: the stored bytes (fused q/k/v and gate/up replace their parts). `fp16`: each
    2-D weight in fbgemm's packed layout (`fp16_packed_bytes`), plus the float16 token
    embedding table for lookups (with tied embeddings the output layer is a packed copy
    of it); 1-D tensors as stored.
    """
    if fmt == "full":
        return sum(t.numel() * t.element_size() for t in tensors.values())
    total = 0
    for name, t in tensors.items():
        if not _is_stored_low(name, t):
            total += t.numel() * t.element_size()
        elif name == "model.embed_tokens.weight":
            total += t.numel() * 2 + (fp16_packed_bytes(*t.shape) if tied_embeddings else 0)
        else:
            total += fp16_packed_bytes(*t.shape)
    return total


class Linear:
    """y = x W^T (+ b) for one weight, in whichever kernel its storage calls for.

    Args:
        weight: [out, in], in `dtype` (plain `F.linear`) or float16 with `dtype` float32
            (fbgemm fp16 GEMM on CPU; widened to float32 elsewhere).
        bias: [out] in `dtype`, or None.
        dtype: the serving dtype of activations.

    Call: x [T, in] in `dtype` -> [T, out] in `dtype`.

    Raises:
        ValueError: a weight dtype that is neither `dtype` nor float16 under float32.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = None
        if weight.dtype != dtype:
            if not (weight.dtype == torch.float16 and dtype == torch.float32):
                raise ValueError(f"weight dtype {weight.dtype} cannot serve {dtype} "
                                 f"activations (expected {dtype}, or float16 under float32)")
            if weight.device.type == "cpu":
                prepack, self._gemm = _fp16_ops()
                # fbgemm copies the weight into its own fp16 layout; the float32 widening
                # is exact and only lives for this call
                self.packed = prepack(weight.float(), bias)
                self.nbytes = (fp16_packed_bytes(*weight.shape)
                               + (bias.nbytes if bias is not None else 0))
                self.weight = self.bias = None
                return
            weight = weight.to(dtype)
        self.weight, self.bias = weight, bias
        self.nbytes = weight.nbytes + (bias.nbytes if bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self._gemm(x, self.packed)
        return F.linear(x, self.weight, self.bias)
