"""A GGUF's own blocks: reading their fields, and building the int8-activation weights
that hold them exactly (`native_weight`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.models.quant.formats import Q8_NAMES
from flare.models.quant.interleaved import Q4x8Weight, Q8x8Weight
from flare.models.quant.kquants import Q4Kx8Weight, Q6Kx8Weight
from flare.models.quant.q5 import Q5Kx8Weight, Q5x8Weight, high_plane
from flare.models.quant.stacked import QuantizedWeight

# ggml's block layouts (32 values a block, little-endian float16 d and m):
#   Q4_0: d, 16 bytes of codes          value = d * (q - 8)
#   Q4_1: d, m, 16 bytes of codes       value = d * q + m
#   Q8_0: d, 32 int8 codes              value = d * q
#   Q5_0: d, 4 bytes qh, 16 bytes qs   value = d * (q - 16), q = nibble | bit j of qh << 4
# and the K-quants' super-blocks of 256 (gguf.quants documents the layouts):
#   Q4_K: d, dmin, 12 bytes of 6-bit sub-block scales sc and mins m (8 of each), 128 bytes
#         of codes (4 runs of 32 bytes: low nibbles sub-block 2r, high ones 2r + 1);
#         value = (d * sc) * q - dmin * m
#   Q5_1: d, m, 4 bytes qh, 16 bytes qs  value = d * q + m (q as Q5_0's)
#   Q5_K: Q4_K's d, dmin and scales, 32 bytes qh (bit t of byte j: sub-block t's element
#         j), 128 bytes of low nibbles as Q4_K's; value = (d * sc) * q - dmin * m
#   Q6_K: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales (one per 16
#         values), d;  value = (d * sc) * (q - 32)
# where code byte j holds element j in its low nibble and element j + 16 in its high one:
# the byte order of `Q4Weight.codes`, so the codes are copied as they are.
GGUF_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q5_0": 22, "Q5_1": 24, "Q4_K": 144,
                    "Q5_K": 176, "Q6_K": 210}
GGUF_BLOCK_VALUES = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 256,
                     "Q5_K": 256, "Q6_K": 256}  # values per block along K
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


def _fields_of(b: GGUFBlocks, kind: str, name: str) -> torch.Tensor:
    """`_block_fields` of a weight that must be of type `kind`. Raises ValueError naming
    `name` where it is another type."""
    if b.kind != kind:
        raise ValueError(f"weight {name!r} is {b.kind}, not {kind}")
    return _block_fields(b)


def _fp16_field(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """float16 [N, K/32] read from bytes at..at+1 of each block."""
    n, nb, _ = blocks.shape
    return blocks[..., at:at + 2].contiguous().view(torch.float16).view(n, nb)


def q4_from_gguf(b: GGUFBlocks, name: str = "weight") -> tuple[torch.Tensor, ...]:
    """(codes uint8 [N, K/2], scales float16 [N, K/32], mins) of a Q4_0 or Q4_1 weight,
    the file's own values: Q4_1's d, m (mins float16 [N, K/32]) and codes; Q4_0's d, its
    codes and no mins (float16 [N, 0]: its min -8d is computed where it is used, exactly,
    and d * q - 8d = d * (q - 8) in float32).

    Raises:
        ValueError: another type (naming `name`).
    """
    blocks = _block_fields(b)
    n = blocks.shape[0]
    d = _fp16_field(blocks, 0)
    if b.kind == "Q4_1":
        return blocks[..., 4:].reshape(n, -1), d, _fp16_field(blocks, 2)
    if b.kind != "Q4_0":
        raise ValueError(f"weight {name!r} is {b.kind}, not Q4_0 or Q4_1")
    return blocks[..., 2:].reshape(n, -1), d, torch.empty(n, 0, dtype=torch.float16)


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
    blocks = _fields_of(b, "Q5_0", name)
    n = blocks.shape[0]
    d = _fp16_field(blocks, 0)
    c = blocks[..., 6:]
    low = torch.cat([c & 0xF, c >> 4], dim=-1).to(torch.int64)
    q = (low | (_q5_fifth_bits(blocks, 2).to(torch.int64) << 4)) - 16
    return q.to(torch.int8).reshape(n, -1), d


def _q5_fifth_bits(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fifth bits, 0/1 uint8 [N, nb, 32] in element order, of Q5_0 / Q5_1 blocks
    whose 4 bytes qh start at `at` (little-endian: bit j of the 32 is element j)."""
    qh = blocks[..., at:at + 4]
    bits = torch.arange(32)
    return (qh[..., bits // 8] >> (bits % 8).to(torch.uint8)) & 1


def q5_from_gguf(b: GGUFBlocks, name: str = "weight") -> tuple[torch.Tensor, ...]:
    """(codes uint8 [N, K/2] (the low nibbles, `Q4Weight`'s byte order), fifth bits
    uint8 [N, K/8] (`high_plane`), scales float16 [N, K/32], mins) of a Q5_0 or Q5_1
    weight, the file's own values: Q5_1's d and m (mins float16 [N, K/32]); Q5_0's d and
    no mins (float16 [N, 0]: its min -16d is computed where it is used, exactly, and
    d * q - 16d = d * (q - 16) in float32, both sides holding at most 16 significant
    bits).

    Raises:
        ValueError: another type (naming `name`).
    """
    if b.kind not in ("Q5_0", "Q5_1"):
        raise ValueError(f"weight {name!r} is {b.kind}, not Q5_0 or Q5_1")
    blocks = _block_fields(b)
    n = blocks.shape[0]
    d = _fp16_field(blocks, 0)
    if b.kind == "Q5_1":
        m, at = _fp16_field(blocks, 2), 4
    else:
        m, at = torch.empty(n, 0, dtype=torch.float16), 2
    codes = blocks[..., at + 4:].reshape(n, -1).contiguous()
    return codes, high_plane(_q5_fifth_bits(blocks, at)), d, m


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
    blocks = _fields_of(b, "Q4_K", name)
    n = blocks.shape[0]
    d, dmin = _fp16_field(blocks, 0), _fp16_field(blocks, 2)
    sc, m = _q4_k_scales(blocks[..., 4:16])
    return (_k_nibbles(blocks[..., 16:]), sc.reshape(n, -1).contiguous(),
            m.reshape(n, -1).contiguous(), d, dmin)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K's 128 bytes of low nibbles uint8 [N, ns, 128] (4 runs of 32 bytes:
    low nibbles sub-block 2r, high ones 2r + 1) as codes uint8 [N, K/2] in `Q4Weight`'s
    byte order (byte j of a block of 32: element j low, j + 16 high)."""
    n, ns, _ = qs.shape
    runs = qs.reshape(n, ns, 4, 32)
    q = torch.stack([runs & 0xF, runs >> 4], dim=3).reshape(n, ns * 8, 32)  # sub-blocks
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(n, -1).contiguous()


def q5_k_from_gguf(b: GGUFBlocks, name: str = "weight") -> tuple[torch.Tensor, ...]:
    """(codes uint8 [N, K/2] (low nibbles, `Q4Weight`'s byte order), fifth bits uint8
    [N, K/8] (`high_plane`), sc uint8 [N, K/32], m uint8 [N, K/32], d, dmin float16
    [N, K/256]) of a Q5_K weight, the file's own values: value = (d * sc) * q - dmin * m,
    as gguf dequantizes it.

    Raises:
        ValueError: another type (naming `name`).
    """
    blocks = _fields_of(b, "Q5_K", name)
    n, ns, _ = blocks.shape
    d, dmin = _fp16_field(blocks, 0), _fp16_field(blocks, 2)
    sc, m = _q4_k_scales(blocks[..., 4:16])
    qh = blocks[..., 16:48].reshape(n, ns, 1, 32)  # bit t of byte j: sub-block t, element j
    high = (qh >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)) & 1  # [N, ns, 8, 32]
    return (_k_nibbles(blocks[..., 48:]), high_plane(high.reshape(n, ns * 8, 32)),
            sc.reshape(n, -1).contiguous(), m.reshape(n, -1).contiguous(), d, dmin)


def q6_k_from_gguf(b: GGUFBlocks, name: str = "weight") -> tuple[torch.Tensor, ...]:
    """(codes int8 [N, K] = q - 32 in -32..31, scales int8 [N, K/16], d float16
    [N, K/256]) of a Q6_K weight, the file's own values: value = (d * sc) * code, as gguf
    dequantizes it.

    Raises:
        ValueError: another type (naming `name`).
    """
    blocks = _fields_of(b, "Q6_K", name)
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


def native_weight(name: str, b: GGUFBlocks, fmt: str, value: torch.Tensor
                  ) -> QuantizedWeight | torch.Tensor | None:
    """A 2-D weight of format `fmt` (`q4x8`, `q8x8` or `kx8`) built from the file's own
    blocks or values, or None where `fmt` cannot hold them exactly (the caller
    re-quantizes).

    Layers: `q4x8` takes Q4_1 and Q4_0 blocks (`q4_from_gguf`), `q8x8` Q8_0, Q5_0 and Q4_0
    (`q8_from_gguf`, `q5_0_from_gguf`). The token embedding and output layer
    (`Q8_NAMES`), in any of them: Q8_0 as `Q8x8Weight`, Q4_0 / Q4_1 as `Q4x8Weight`, F16 /
    BF16 / F32 as the float tensor `value` (float16 where every value converts exactly,
    else as given). `kx8`, layers and the rest alike: Q4_K as `Q4Kx8Weight`, Q5_K as
    `Q5Kx8Weight`, Q6_K as `Q6Kx8Weight`, Q5_0 / Q5_1 as `Q5x8Weight`, Q8_0 as
    `Q8x8Weight`, Q4_0 / Q4_1 as `Q4x8Weight`.
    """
    other = name in Q8_NAMES or fmt == "kx8"  # kx8 holds every listed type anywhere
    if b.data is not None and fmt == "kx8":
        if b.kind == "Q4_K":
            return Q4Kx8Weight.of(*q4_k_from_gguf(b, name), name=name)
        if b.kind == "Q5_K":
            return Q5Kx8Weight.of(*q5_k_from_gguf(b, name), name=name)
        if b.kind == "Q6_K":
            return Q6Kx8Weight.of(*q6_k_from_gguf(b, name), name=name)
        if b.kind in ("Q5_0", "Q5_1"):
            return Q5x8Weight.of(*q5_from_gguf(b, name), name=name)
    if b.data is not None and b.kind == "Q5_0" and (other or fmt == "q8x8"):
        return Q8x8Weight.of(*q5_0_from_gguf(b, name), name)
    if b.kind in GGUF_FLOAT_TYPES:
        if name not in Q8_NAMES:
            return None
        half = value.half()
        return half if torch.equal(half.to(value.dtype), value) else value
    if b.data is None:
        return None
    if b.kind == "Q8_0" and (other or fmt == "q8x8"):
        return Q8x8Weight.of(*q8_from_gguf(b, name), name)
    if b.kind == "Q4_0" and fmt == "q8x8" and not other:
        return Q8x8Weight.of(*q8_from_gguf(b, name), name)
    if b.kind in ("Q4_0", "Q4_1") and (other or fmt == "q4x8"):
        return Q4x8Weight.of(*q4_from_gguf(b, name), name)
    return None
