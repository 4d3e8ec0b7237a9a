"""Format `kx8`'s K-quant weights: a GGUF's Q4_K and Q6_K blocks as stored, in the 8-row
interleaved layout, run with int8 activations."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.models.quant.blocks import QBLOCK
from flare.models.quant.interleaved import (
    NibbleParts,
    check_groups,
    deinterleave,
    interleave,
    pick_rows,
)


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
class Q4Kx8Weight(NibbleParts):
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
           dmin: torch.Tensor, name: str = "weight") -> Q4Kx8Weight:
        """From row-order parts (`q4_k_from_gguf`). Raises ValueError: N is not a multiple
        of 8 (naming `name`)."""
        check_groups(codes.shape[0], name)
        return cls(interleave(codes.contiguous(), 4), interleave(sc.contiguous(), 1),
                   interleave(m.contiguous(), 1), interleave(d.contiguous(), 1),
                   interleave(dmin.contiguous(), 1))

    def parts(self) -> tuple[torch.Tensor, ...]:
        """(codes, scales, mins, d, dmin), in `Q4KX8_SUFFIXES` order."""
        return self.codes, self.scales, self.mins, self.d, self.dmin

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        return q4_k_values(pick_rows(self.codes, rows, 4), pick_rows(self.scales, rows, 1),
                           pick_rows(self.mins, rows, 1), pick_rows(self.d, rows, 1),
                           pick_rows(self.dmin, rows, 1))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return q4_k_values(deinterleave(self.codes, 4), deinterleave(self.scales, 1),
                           deinterleave(self.mins, 1), deinterleave(self.d, 1),
                           deinterleave(self.dmin, 1))


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
           name: str = "weight") -> Q6Kx8Weight:
        """From row-order parts (`q6_k_from_gguf`). Raises ValueError: N is not a multiple
        of 8 (naming `name`)."""
        check_groups(codes.shape[0], name)
        return cls(interleave(codes.contiguous(), 4), interleave(sc.contiguous(), 1),
                   interleave(d.contiguous(), 1))

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
        return q6_k_values(pick_rows(self.codes, rows, 4), pick_rows(self.scales, rows, 1),
                           pick_rows(self.d, rows, 1))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return q6_k_values(deinterleave(self.codes, 4), deinterleave(self.scales, 1),
                           deinterleave(self.d, 1))
