"""Formats `q4x8` and `q8x8`: `q4`'s blocks with 8 rows interleaved, run with int8
activations, and the layout helpers the K-quant weights share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.models.quant.blocks import QBLOCK, Q4Weight, Q8Weight
from flare.models.quant.formats import FP16_MAX

# Rows 8g..8g+7 of a weight form group g. Per group and block, q4 codes are 4 chunks of
# 32 bytes and q8 codes 8 chunks: chunk c holds, for each row i of the group, the row's
# block bytes 4c..4c+3 at bytes 4i..4i+3; scales and mins are float16 [block, row] (a
# GGUF's own precision: 20 bytes a q4 block instead of 24, 34 a q8 one). One load then
# feeds 8 output rows (see kernels/qdot8.cpp). As tensors the parts keep their `q4`/`q8`
# shapes ([N, K/2], [N, K], [N, K/32]); groups are contiguous runs of 8 rows, so fusing
# weights (q/k/v, gate/up) is still a concatenation along the output axis.

def interleave(t: torch.Tensor, bytes_per_chunk: int) -> torch.Tensor:
    """Rows [N, C] (C = blocks x chunks x `bytes_per_chunk`) into the group layout."""
    n, c = t.shape
    chunks = c // bytes_per_chunk
    return (t.reshape(n // 8, 8, chunks, bytes_per_chunk).permute(0, 2, 1, 3)
            .contiguous().view(n, c))


def deinterleave(t: torch.Tensor, bytes_per_chunk: int) -> torch.Tensor:
    n, c = t.shape
    chunks = c // bytes_per_chunk
    return (t.reshape(n // 8, chunks, 8, bytes_per_chunk).permute(0, 2, 1, 3)
            .contiguous().view(n, c))


def check_groups(n: int, name: str) -> None:
    if n % 8:
        raise ValueError(f"weight {name!r} has {n} output rows: weight formats 'q4x8' and "
                         f"'q8x8' need a multiple of 8; use --weights q4 or fp16")


class NibbleParts:
    """Shared by the block weights held as `parts()` with 4-bit `codes` [N, K/2]
    (Q4_K, Q5_0 / Q5_1, Q5_K): shape (N, K) and bytes held (the sum of the parts)."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 2

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts())


def _half(t: torch.Tensor, name: str) -> torch.Tensor:
    """Block scales or mins as float16. Raises ValueError naming the weight when one is
    beyond float16's range (it would turn infinite)."""
    h = t.half()
    if not bool(torch.isfinite(h).all()):
        raise ValueError(f"weight {name!r} has block scales or mins beyond float16's range "
                         f"(+-{FP16_MAX:g}): weight formats 'q4x8' and 'q8x8' store them "
                         f"as float16; use --weights q4")
    return h


def q4_mins(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """float32 block mins [N, K/32] (either layout): `mins` widened, or for Q4_0's empty
    mins ([N, 0]) -8 x `scales` (exact in float32: a power-of-two multiple of a
    float16, the value a stored float16 -8d widens to)."""
    return scales.float() * -8 if mins.shape[-1] == 0 else mins.float()


@dataclass(frozen=True)
class Q4x8Weight:
    """A `Q4Weight` [N, K] in the 8-row interleaved layout, run with int8 activations.

    Attributes:
        codes: uint8 [N, K/2]; scales: float16 [N, K/32] (see the layout above; float16
            as in a GGUF's Q4_1 blocks: `pack` rounds float32 ones to nearest).
        mins: float16 [N, K/32] (group layout); a Q4_0 weight holds none, float16
            [N, 0]: its min is -8d, which the kernel and `dequantize` compute (exact), so
            it takes 4.5 bits a value, as in the file.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor

    @classmethod
    def of(cls, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
           name: str = "weight") -> Q4x8Weight:
        """From row-order parts (codes uint8 [N, K/2]; scales float16 [N, K/32]; mins
        float16 [N, K/32] or [N, 0], as `q4_from_gguf` reads them). Raises ValueError: N
        is not a multiple of 8 (naming `name`)."""
        check_groups(codes.shape[0], name)
        return cls(interleave(codes.contiguous(), 4), interleave(scales, 1),
                   interleave(mins, 1) if mins.shape[1] else mins.contiguous())

    @classmethod
    def pack(cls, w: Q4Weight, name: str = "weight") -> Q4x8Weight:
        """Raises ValueError: a scale or min beyond float16's range, or N is not a
        multiple of 8 (naming `name`)."""
        return cls.of(w.codes, _half(w.scales, name), _half(w.mins, name), name)

    def unpack(self) -> Q4Weight:
        """The row-order `Q4Weight` (float32 scales and mins; Q4_0's mins computed)."""
        return Q4Weight(deinterleave(self.codes, 4), deinterleave(self.scales, 1).float(),
                        deinterleave(q4_mins(self.scales, self.mins), 1))

    def with_mins(self) -> Q4x8Weight:
        """This weight with its mins stored (Q4_0's -8d as float16, exact), so it can be
        fused along the output axis with a Q4_1 weight (`cat_weights`); the same values.

        Raises:
            ValueError: a scale whose -8d is beyond float16's range (it would turn
                infinite).
        """
        if self.mins.shape[1]:
            return self
        mins = q4_mins(self.scales, self.mins).half()
        if not bool(torch.isfinite(mins).all()):
            raise ValueError("a Q4_0 weight fused with a Q4_1 one has scales whose min -8d "
                             "is beyond float16's range; use --weights fp16")
        return Q4x8Weight(self.codes, self.scales, mins)

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
        scales = self.scales.view(n // 8, k // QBLOCK, 8)[g, :, i]
        mins = (self.mins.view(n // 8, k // QBLOCK, 8)[g, :, i] if self.mins.shape[1]
                else torch.empty(t, 0, dtype=torch.float16))
        return (q * scales.float().unsqueeze(-1)
                + q4_mins(scales, mins).unsqueeze(-1)).view(t, k)

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
    def of(cls, codes: torch.Tensor, scales: torch.Tensor,
           name: str = "weight") -> Q8x8Weight:
        """From row-order parts (codes int8 [N, K], scales float16 [N, K/32], as
        `q8_from_gguf` and `q5_0_from_gguf` read them). Raises ValueError: N is not a
        multiple of 8 (naming `name`)."""
        check_groups(codes.shape[0], name)
        return cls(interleave(codes.contiguous(), 4), interleave(scales, 1))

    @classmethod
    def pack(cls, w: Q8Weight, name: str = "weight") -> Q8x8Weight:
        """Raises ValueError: a scale beyond float16's range, or N is not a multiple of 8
        (naming `name`)."""
        return cls.of(w.codes, _half(w.scales, name), name)

    def unpack(self) -> Q8Weight:
        return Q8Weight(deinterleave(self.codes, 4), deinterleave(self.scales, 1).float())

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


def pick_rows(t: torch.Tensor, rows: torch.Tensor, bytes_per_chunk: int) -> torch.Tensor:
    """Rows `rows` (int64 [T]) of a part in the group layout, un-interleaved: [T, C]."""
    n, c = t.shape
    picked = t.view(n // 8, c // bytes_per_chunk, 8, bytes_per_chunk)[rows // 8, :, rows % 8]
    return picked.reshape(rows.shape[0], c)
