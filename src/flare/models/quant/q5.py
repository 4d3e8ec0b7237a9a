"""Format `kx8`'s 5-bit weights: a GGUF's Q5_0, Q5_1 and Q5_K blocks as stored, in the
8-row interleaved layout, run with int8 activations.

A 5-bit code is `q4x8`'s low nibble plus a fifth bit. The fifth bits of a block of 32
live in a plane of 4 bytes a row, byte b holding in bit s the fifth bit of element
4s + b: in the group layout (4 bytes a row, 32 bytes a group block) one shift and mask
of the plane's 32 bytes gives every row's fifth bits for the 4 elements that one chunk
of `q4x8`'s codes holds (kernels/qdot8.cpp, `q5_group`).
"""

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


def high_plane(h: torch.Tensor) -> torch.Tensor:
    """Fifth bits uint8 [N, nb, 32] (0 or 1, element order) as the plane, uint8
    [N, nb * 4]: byte b of a block holds in bit s the fifth bit of element 4s + b."""
    n, nb, _ = h.shape
    h = h.to(torch.uint8).view(n, nb, 8, 4)
    plane = torch.zeros(n, nb, 4, dtype=torch.uint8)
    for bit in range(8):
        plane |= h[:, :, bit, :] << bit
    return plane.view(n, nb * 4)


def plane_bits(plane: torch.Tensor) -> torch.Tensor:
    """`high_plane`'s inverse: uint8 [N, nb * 4] -> 0/1 uint8 [N, nb, 32]."""
    n = plane.shape[0]
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)
    return ((plane.view(n, -1, 1, 4) >> shifts) & 1).view(n, -1, 32)


def q5_codes(codes: torch.Tensor, plane: torch.Tensor) -> torch.Tensor:
    """5-bit codes float32 [N, K/32, 32] (0..31) of row-order low nibbles uint8 [N, K/2]
    (`Q4Weight`'s byte order) and their plane uint8 [N, K/8]."""
    n = codes.shape[0]
    c = codes.view(n, -1, QBLOCK // 2)
    low = torch.cat([c & 0xF, c >> 4], dim=-1)
    return (low | (plane_bits(plane) << 4)).float()


def q5_mins(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """float32 block mins [N, K/32]: `mins` widened, or for Q5_0's empty mins ([N, 0])
    -16 x `scales` (exact in float32: a power-of-two multiple of a float16)."""
    return scales.float() * -16 if mins.shape[-1] == 0 else mins.float()


def q5_values(codes: torch.Tensor, high: torch.Tensor, scales: torch.Tensor,
              mins: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of Q5_0 / Q5_1 parts in row order (`q5_from_gguf`'s shapes):
    scale * q + min per block of 32 (scale * q exact in float32, one rounding after;
    Q5_0: min -16 x scale, so d * q - 16d = d * (q - 16), gguf's value, exactly)."""
    q = q5_codes(codes, high)
    return (q * scales.float().unsqueeze(-1) + q5_mins(scales, mins).unsqueeze(-1)).view(
        codes.shape[0], -1)


def q5_k_values(codes: torch.Tensor, high: torch.Tensor, sc: torch.Tensor, m: torch.Tensor,
                d: torch.Tensor, dmin: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of Q5_K parts in row order (`q5_k_from_gguf`'s shapes): Q4_K's
    (d * sc) * q - dmin * m on 5-bit codes, with gguf's roundings."""
    n = codes.shape[0]
    q = q5_codes(codes, high)
    scale = d.float().repeat_interleave(8, dim=1) * sc.float()  # [N, K/32], exact
    low = dmin.float().repeat_interleave(8, dim=1) * m.float()
    return (q * scale.unsqueeze(-1) - low.unsqueeze(-1)).view(n, -1)


@dataclass(frozen=True)
class Q5x8Weight(NibbleParts):
    """A GGUF Q5_0 or Q5_1 weight [N, K] as stored (5 bits a value), in the 8-row
    interleaved layout, run with int8 activations (`q5x8_linear`, kernels/qdot8.cpp:
    `q4x8`'s arithmetic on 5-bit codes).

    Attributes:
        codes: uint8 [N, K/2], the low nibbles in `Q4x8Weight`'s layout.
        high: uint8 [N, K/8], the fifth bits (`high_plane`), 4 bytes a row in each
            32-byte group chunk.
        scales: float16 [N, K/32] (group layout).
        mins: Q5_1's, float16 [N, K/32] (group layout); Q5_0 holds none, float16
            [N, 0]: its min is -16d, which the kernel and `dequantize` compute (exact),
            so a Q5_0 weight takes 5.5 bits a value, as in the file.

    Value: scale * q + min, equal to gguf's dequantization bit for bit. Indexing with row
    ids (int64 [T]) returns those rows dequantized, float32 [T, K].
    """

    codes: torch.Tensor
    high: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @classmethod
    def of(cls, codes: torch.Tensor, high: torch.Tensor, scales: torch.Tensor,
           mins: torch.Tensor, name: str = "weight") -> Q5x8Weight:
        """From row-order parts (`q5_from_gguf`). Raises ValueError: N is not a multiple
        of 8 (naming `name`)."""
        check_groups(codes.shape[0], name)
        return cls(interleave(codes.contiguous(), 4), interleave(high.contiguous(), 4),
                   interleave(scales.contiguous(), 1), interleave(mins.contiguous(), 1))

    def parts(self) -> tuple[torch.Tensor, ...]:
        """(codes, high, scales, mins), in `Q5X8_SUFFIXES` order."""
        return self.codes, self.high, self.scales, self.mins

    def with_mins(self) -> Q5x8Weight:
        """This weight with its mins stored (Q5_0's -16d as float16, exact), so it can be
        fused along the output axis with a Q5_1 weight (`cat_weights`); the same values.

        Raises:
            ValueError: a scale whose -16d is beyond float16's range (it would turn
                infinite).
        """
        if self.mins.shape[1]:
            return self
        mins = q5_mins(self.scales, self.mins).half()
        if not bool(torch.isfinite(mins).all()):
            raise ValueError("a Q5_0 weight fused with a Q5_1 one has scales whose min -16d "
                             "is beyond float16's range; use --weights fp16")
        return Q5x8Weight(self.codes, self.high, self.scales, mins)

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        return q5_values(pick_rows(self.codes, rows, 4), pick_rows(self.high, rows, 4),
                         pick_rows(self.scales, rows, 1), pick_rows(self.mins, rows, 1))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return q5_values(deinterleave(self.codes, 4), deinterleave(self.high, 4),
                         deinterleave(self.scales, 1), deinterleave(self.mins, 1))


# bytes a chunk of each of `Q5Kx8Weight`'s parts, in `parts()` order
_Q5K_CHUNKS = (4, 4, 1, 1, 1, 1)


@dataclass(frozen=True)
class Q5Kx8Weight(NibbleParts):
    """A GGUF Q5_K weight [N, K] (K a multiple of 256) as stored, in the 8-row
    interleaved layout, run with int8 activations (`q5kx8_linear`: `Q5x8Weight`'s 5-bit
    codes with `Q4Kx8Weight`'s scales, computed exactly in float32).

    Attributes:
        codes, high: uint8 [N, K/2] and [N, K/8], as `Q5x8Weight`'s.
        scales, mins: uint8 [N, K/32], the 6-bit sub-block sc and m (group layout).
        d, dmin: float16 [N, K/256], the super-blocks' d and dmin (group layout).

    Value: (d * sc) * q - dmin * m, equal to gguf's dequantization bit for bit. Indexing
    with row ids (int64 [T]) returns those rows dequantized, float32 [T, K].
    """

    codes: torch.Tensor
    high: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor

    @classmethod
    def of(cls, codes: torch.Tensor, high: torch.Tensor, sc: torch.Tensor, m: torch.Tensor,
           d: torch.Tensor, dmin: torch.Tensor, name: str = "weight") -> Q5Kx8Weight:
        """From row-order parts (`q5_k_from_gguf`). Raises ValueError: N is not a
        multiple of 8 (naming `name`)."""
        check_groups(codes.shape[0], name)
        return cls(*(interleave(t.contiguous(), c)
                     for t, c in zip((codes, high, sc, m, d, dmin), _Q5K_CHUNKS)))

    def parts(self) -> tuple[torch.Tensor, ...]:
        """(codes, high, scales, mins, d, dmin), in `Q5KX8_SUFFIXES` order."""
        return self.codes, self.high, self.scales, self.mins, self.d, self.dmin

    def __getitem__(self, rows: torch.Tensor) -> torch.Tensor:
        return q5_k_values(*(pick_rows(t, rows, c) for t, c in zip(self.parts(), _Q5K_CHUNKS)))

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]."""
        return q5_k_values(*(deinterleave(t, c) for t, c in zip(self.parts(), _Q5K_CHUNKS)))
