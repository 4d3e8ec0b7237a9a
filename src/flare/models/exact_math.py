"""cos, sin, exp and log1p on the CPU without torch's routines (MKL's vector math, VML), so
that a value never depends on which call or thread computed it.

torch's float32 `cos` and `sin` on CPU run MKL's vector math (VML) over each thread's
share of the tensor, and once in a while one share comes back at VML's low-accuracy
"enhanced performance" level instead of its high-accuracy one: in `pytest
tests/unit/test_kquant.py`, about one process in four built a llama table whose
positions 1-127 (the first thread's half of 256 x 64) were up to 1.5e-4 off, cos(1) =
0.5403335 instead of 0.5403023 (exactly what `vmsCos` gives in mode VML_EP), while a
second engine built moments later in the same process had the right table. The wrong
table moved an activation across an int8 rounding midpoint: that engine's logits were
1.3e-2 from those of the engines built after it. So the tables are made here without VML (`rope_cos_sin`): numpy's float64 cos
and sin of the float32 angles (which stay what transformers computes: position *
inv_freq in float32), each rounded once to float32.

The hybrids' activations and decay (`hybrid_common.sigmoid`, `silu`, `softplus`, the
gated delta rule's exp(g)) take `exp` and `log1p` from here for the same reason: numpy's
float32 routines, which run one vectorized routine over every element (the last ones of
a buffer through masked loads) or one scalar routine per element, so a row's values do
not depend on where it lies in the batch. Off the CPU (CUDA) and for other dtypes they
are torch's.
"""

from __future__ import annotations

import numpy as np
import torch


def _numpy_able(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)


def exp(x: torch.Tensor) -> torch.Tensor:
    """Elementwise e^x: numpy's on CPU float32/float64 (overflow to inf, no warning),
    torch's otherwise.

    Args:
        x: any shape, floating dtype, any device. Returns: same shape, dtype and device.
    """
    if not _numpy_able(x):
        return torch.exp(x)
    with np.errstate(over="ignore", under="ignore"):
        return torch.from_numpy(np.exp(x.detach().numpy()))


def log1p(x: torch.Tensor) -> torch.Tensor:
    """Elementwise log(1 + x): numpy's on CPU float32/float64, torch's otherwise.

    Args:
        x: any shape, floating dtype, any device; x >= -1. Returns: same shape, dtype and
        device (nan below -1, -inf at -1, without warnings).
    """
    if not _numpy_able(x):
        return torch.log1p(x)
    with np.errstate(all="ignore"):
        return torch.from_numpy(np.log1p(x.detach().numpy()))


def cos_sin(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each angle, computed in float64 and rounded once to float32.

    Args:
        angles: any shape, float32, radians, on the CPU.
    Returns:
        (cos, sin): the shape of `angles`, float32, CPU.
    Raises:
        TypeError: `angles` is not a float32 tensor.
    """
    if angles.dtype != torch.float32:
        raise TypeError(f"angles must be float32, got {angles.dtype}")
    wide = angles.detach().cpu().numpy().astype(np.float64)
    return (torch.from_numpy(np.cos(wide).astype(np.float32)),
            torch.from_numpy(np.sin(wide).astype(np.float32)))


def rope_cos_sin(inv_freq: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The cos and sin tables of RoPE over `positions` positions (`cos_sin` of the angles).

    The angles are built as transformers builds them: position * inv_freq in float32,
    the halves duplicated (`rotate_half` layout).

    Args:
        inv_freq: [D / 2] float32, the inverse frequencies (radians per position).
        positions: how many positions, 0 .. positions - 1.
    Returns:
        (cos, sin): [positions, D] float32, CPU.
    """
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    return cos_sin(torch.cat([freqs, freqs], dim=-1))
