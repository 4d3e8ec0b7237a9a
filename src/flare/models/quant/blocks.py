"""Format `q4`'s blocks in row order: Q4_1-style layer weights and Q8_0-style ones, and
the quantizers that make them from floats."""

from __future__ import annotations

from dataclasses import dataclass

import torch

QBLOCK = 32  # values per block of `q4` / `q8` weights, along the input axis


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
