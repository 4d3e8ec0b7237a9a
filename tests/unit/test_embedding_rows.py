"""The native token lookup (kernels/rows.cpp through `native_layers.native_embedding`) gives
the bits of the weights' own `__getitem__` (`Q8x8Weight`, `Q4x8Weight` with Q4_1 mins and
Q4_0's none): every row of a weight, repeated and unordered ids, codes at both ends of
their range, scales from float16's subnormals to its largest values; bad ids raise. And the
decode group's gather built by `page_gather` equals the one torch's operations build."""

from __future__ import annotations

import pytest
import torch

from flare.models.native_layers import native_embedding
from flare.models.quant.interleaved import Q4x8Weight, Q8x8Weight, interleave

kernels = pytest.importorskip("flare.kernels")
OPS = kernels.fused_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="Flare's kernel module is unavailable")

N, K = 40, 96  # 5 groups of 8 rows, 3 blocks of 32


def scales(g: torch.Generator, n: int, cols: int) -> torch.Tensor:
    """float16 [n, cols]: random values spanning float16's range, some subnormal, a zero,
    negatives and the largest finite magnitudes."""
    exp = torch.randint(-24, 16, (n, cols), generator=g).float()
    sign = torch.where(torch.rand(n, cols, generator=g) < 0.3, -1.0, 1.0)
    s = (sign * torch.rand(n, cols, generator=g) * 2.0 ** exp).half()
    s[0, 0], s[1, 0], s[2, 0] = 0.0, 65504.0, -65504.0
    s[3, 0] = 2.0 ** -24  # the smallest subnormal
    return s


def ids_of_every_row(g: torch.Generator) -> torch.Tensor:
    """int64 [2N + 3]: every row in a random order, then every row again, then repeats."""
    return torch.cat([torch.randperm(N, generator=g), torch.arange(N),
                      torch.tensor([7, 7, N - 1])])


def q8_weight(g: torch.Generator) -> Q8x8Weight:
    codes = torch.randint(-128, 128, (N, K), generator=g, dtype=torch.int8)
    codes[0, :32], codes[1, :32] = -128, 127  # both ends across a block
    return Q8x8Weight(interleave(codes, 4), interleave(scales(g, N, K // 32), 1))


def q4_weight(g: torch.Generator, with_mins: bool) -> Q4x8Weight:
    codes = torch.randint(0, 256, (N, K // 2), generator=g, dtype=torch.uint8)
    codes[0, :16], codes[1, :16] = 0x0F, 0xF0
    mins = (interleave(scales(g, N, K // 32), 1) if with_mins
            else torch.empty(N, 0, dtype=torch.float16))
    return Q4x8Weight(interleave(codes, 4), interleave(scales(g, N, K // 32), 1), mins)


WEIGHTS = {"q8_0": lambda g: q8_weight(g), "q4_1": lambda g: q4_weight(g, True),
           "q4_0": lambda g: q4_weight(g, False)}


@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_rows_are_the_bits_of_getitem(kind):
    g = torch.Generator().manual_seed(11)
    weight = WEIGHTS[kind](g)
    lookup = native_embedding(weight, OPS)
    assert lookup is not None
    ids = ids_of_every_row(g)
    got, want = lookup(ids), weight[ids]
    assert got.dtype == torch.float32 and got.shape == (len(ids), K)
    assert torch.equal(got.view(torch.int32), want.contiguous().view(torch.int32))
    # and the rows are the dequantized weight's (the reference the formats define)
    assert torch.equal(got[N:2 * N], weight.dequantize())


@pytest.mark.parametrize("kind", list(WEIGHTS))
def test_no_ids_give_no_rows(kind):
    weight = WEIGHTS[kind](torch.Generator().manual_seed(2))
    got = native_embedding(weight, OPS)(torch.empty(0, dtype=torch.int64))
    assert got.shape == (0, K)


@pytest.mark.parametrize("kind", list(WEIGHTS))
@pytest.mark.parametrize("bad", [-1, N])
def test_an_id_outside_the_table_raises(kind, bad):
    weight = WEIGHTS[kind](torch.Generator().manual_seed(3))
    with pytest.raises(RuntimeError, match=f"id {bad} is outside"):
        native_embedding(weight, OPS)(torch.tensor([0, bad]))


def test_other_tables_keep_the_python_lookup():
    assert native_embedding(torch.randn(N, K), OPS) is None  # a dense table
    assert native_embedding(q8_weight(torch.Generator().manual_seed(4)), None) is None


def test_page_gather_is_the_torch_decode_group():
    """`_decode_group` with the kernel module (one `page_gather` call) builds the gather,
    lengths and mask the torch operations build: one sequence on scattered pages, batches
    of unequal lengths, a sequence holding more pages than it fills, page sizes 1 and 16."""
    from flare.runtime.forward import _decode_group

    g = torch.Generator().manual_seed(7)
    cases = [([[63, 0, 1, 2]], [50], 16), ([[3, 9]], [17], 16), ([[4]], [1], 16),
             ([[8, 2, 5], [1], [7, 6, 0, 3]], [40, 9, 64], 16),
             ([[5, 6, 7, 1]], [3], 1)]
    for _ in range(20):
        b = int(torch.randint(1, 6, (1,), generator=g))
        lengths = torch.randint(1, 200, (b,), generator=g).tolist()
        pages = [torch.randperm(64, generator=g)[:-(-n // 16) + int(torch.randint(0, 2, (1,),
                 generator=g))].tolist() for n in lengths]
        cases.append((pages, lengths, 16))
    for pages, lengths, ps in cases:
        want = _decode_group(pages, lengths, ps, [3] * len(lengths))
        got = _decode_group(pages, lengths, ps, [3] * len(lengths), OPS)
        assert torch.equal(got.gather, want.gather), (pages, lengths)
        assert got.gather.is_contiguous() and got.gather.dtype == torch.int64
        assert torch.equal(got.lengths, want.lengths)
        assert (got.mask is None) == (want.mask is None)
        assert got.mask is None or torch.equal(got.mask, want.mask)
        assert got.span == want.span and torch.equal(got.state_slots, want.state_slots)


def test_page_gather_refuses_bad_tables():
    with pytest.raises(RuntimeError, match="at least 1"):
        OPS.page_gather([[1]], [0], 16)
    with pytest.raises(RuntimeError, match="page_size"):
        OPS.page_gather([[1]], [4], 0)
    with pytest.raises(RuntimeError, match="B >= 1"):
        OPS.page_gather([[1], [2]], [4], 16)
