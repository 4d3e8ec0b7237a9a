"""The kernels' `argmax_rows` (kernels/sample.cpp) picks torch.argmax's index on every row:
ties, signed zeros, infinities, NaN anywhere, widths around the vector blocks; and greedy
sampling through it gives the tokens torch.argmax gives."""

from __future__ import annotations

import pytest
import torch

from flare.runtime.request import SamplingParams
from flare.runtime.sampling import greedy_tokens, sample

kernels = pytest.importorskip("flare.kernels")
OPS = kernels.fused_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason="Flare's kernel module is unavailable")

WIDTHS = [1, 7, 8, 15, 16, 17, 31, 33, 49152]


def rows_of_every_kind(v: int) -> torch.Tensor:
    """[R, v] float32 rows whose argmax is easy to get wrong."""
    g = torch.Generator().manual_seed(v)
    rows = [torch.randn(v, generator=g) for _ in range(4)]
    rows.append(torch.full((v,), -float("inf")))
    rows.append(torch.zeros(v))
    signed = torch.zeros(v)
    signed[::2] = -0.0
    rows.append(signed)
    small = torch.randint(0, 3, (v,), generator=g).float()  # many ties at the max
    rows.append(small)
    for at in {0, v // 2, v - 1}:
        r = torch.randn(v, generator=g)
        r[at] = float("inf")
        rows.append(r)
        r = torch.randn(v, generator=g)
        r[at] = float("nan")
        rows.append(r)
        r = torch.randn(v, generator=g)
        r[at] = 1e30
        r[(at + 1) % v] = 1e30  # a tie between neighbours
        rows.append(r)
    rows.append(torch.full((v,), float("nan")))  # every value NaN: the first
    two_nans = torch.randn(v, generator=g)
    two_nans[v - 1] = float("nan")
    two_nans[v // 3] = float("nan")
    rows.append(two_nans)
    return torch.stack(rows)


@pytest.mark.parametrize("v", WIDTHS)
def test_argmax_rows_equals_torch_argmax(v):
    x = rows_of_every_kind(v)
    assert OPS.argmax_rows(x).tolist() == torch.argmax(x, dim=-1).tolist()


def test_argmax_rows_over_many_rows_and_none():
    x = torch.randn(37, 1000, generator=torch.Generator().manual_seed(3))
    assert OPS.argmax_rows(x).tolist() == torch.argmax(x, dim=-1).tolist()
    assert OPS.argmax_rows(torch.empty(0, 5)).tolist() == []


def test_argmax_rows_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="float32"):
        OPS.argmax_rows(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="float32"):
        OPS.argmax_rows(torch.zeros(2, 4)[:, ::2])  # not contiguous
    with pytest.raises(RuntimeError, match="column"):
        OPS.argmax_rows(torch.zeros(2, 0))


def test_greedy_sampling_takes_the_kernel_and_gives_torch_argmax_tokens(monkeypatch):
    x = rows_of_every_kind(49152)
    want = torch.argmax(x, dim=-1).tolist()
    params = [SamplingParams(temperature=0)] * x.shape[0]
    gens = [torch.Generator() for _ in params]
    calls = []
    kernel = OPS.argmax_rows
    monkeypatch.setattr(OPS, "argmax_rows", lambda t: calls.append(t.shape) or kernel(t))
    assert sample(x.clone(), params, gens).tokens == want
    assert greedy_tokens(x[:, ::2]) == torch.argmax(x[:, ::2], dim=-1).tolist()  # a view
    assert calls == [x.shape, (x.shape[0], x.shape[1] // 2)]
    assert greedy_tokens(x.double()) == want  # not float32: torch.argmax
    monkeypatch.setenv("FLARE_FUSED_OPS", "0")  # the torch path
    assert sample(x.clone(), params, gens).tokens == want
    assert len(calls) == 2
