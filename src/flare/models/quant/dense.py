"""The dense GEMMs a float weight runs on: Flare's row-invariant kernels, or fbgemm's
fp16 GEMM where they cannot be had; each looked up once per process."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

_FP16_GEMM = None


def fp16_ops() -> tuple[Callable, Callable]:
    """fbgemm's fp16 prepack and GEMM ops, resolved once. The GEMM is called through the
    overload's C++ entry point (`_op`), which skips a few microseconds of Python argument
    checks per call (121 calls per decode step of the embedded model)."""
    global _FP16_GEMM
    if _FP16_GEMM is None:
        gemm = torch.ops.quantized.linear_dynamic_fp16.default
        _FP16_GEMM = (torch.ops.quantized.linear_prepack_fp16.default,
                      getattr(gemm, "_op", gemm))
    return _FP16_GEMM


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
