"""`Linear`: y = x W^T (+ b) for one weight, in the kernel its storage calls for."""

from __future__ import annotations

import threading
import warnings

import torch
import torch.nn.functional as F

from flare.models.quant.blocks import Q4Weight
from flare.models.quant.dense import dense_kernels, fp16_ops
from flare.models.quant.interleaved import Q4x8Weight, Q8x8Weight
from flare.models.quant.kquants import Q4Kx8Weight, Q6Kx8Weight
from flare.models.quant.q5 import Q5Kx8Weight, Q5x8Weight
from flare.models.quant.sizes import fbgemm_fp16_packed_bytes
from flare.models.quant.stacked import BLOCK_KINDS, QuantizedWeight, StackedWeight

# Calls with at most this many rows run in the q4 kernel; larger ones dequantize the
# weight into a scratch buffer and use F.linear (MKL). Measured on the 2-core AVX2 machine
# (one thread, CPU time, min of 5, 30 layers of the embedded model's four shapes): kernel
# 90.8 ms at 16 rows, dequantize + MKL 89.2 ms at 17; below 16 rows the kernel wins.
Q_KERNEL_MAX_ROWS = 16
# The output layer's q8 kernel up to this many rows; beyond, slabs of rows are dequantized
# with torch ops and multiplied by MKL (55 ms at 17 rows against the kernel's 15 at 16: the
# kernel stays ahead to about 64; only the last rows of many sequences at once get there).
Q8_KERNEL_MAX_ROWS = 64



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
            `Q6Kx8Weight`, `Q5x8Weight`, `Q5Kx8Weight`, or a `StackedWeight` of them, one
            kernel a part) with `dtype`
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
        if isinstance(weight, BLOCK_KINDS):
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
                prepack, self._gemm = fp16_ops()
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
        elif isinstance(w, Q5x8Weight):
            y = k.q5x8_linear(x, w.codes, w.high, w.scales, w.mins)
        elif isinstance(w, Q5Kx8Weight):
            y = k.q5kx8_linear(x, w.codes, w.high, w.scales, w.mins, w.d, w.dmin)
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
