"""Releasing a thread's OpenMP workers (flare.runtime.openmp), as Engine.start does before
the step loop's thread takes over: libgomp must accept it, and kernels that go parallel
afterwards, on this thread or another, must give the same bits as before."""

from __future__ import annotations

import threading

import pytest
import torch

from flare import kernels
from flare.runtime.openmp import release_thread_pool


def _libgomp_loaded() -> bool:
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return any("libgomp" in line for line in maps)


def _q4_problem() -> tuple[torch.Tensor, ...]:
    """x [8, 576] and a q4x8 weight [3072, 576] (codes, scales, mins): enough groups that
    q4x8_linear splits them over the threads."""
    g = torch.Generator().manual_seed(7)
    n, k = 3072, 576
    codes = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01).half()
    mins = (torch.rand(n, k // 32, generator=g) * -0.01).half()
    return torch.randn(8, k, generator=g), codes, scales, mins


def test_release_is_accepted_and_changes_no_result():
    if not _libgomp_loaded():
        pytest.skip("this torch build loads no libgomp: nothing to release")
    module = kernels.qgemm()
    x, *w = _q4_problem()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a pool with a worker to release, on any machine
    try:
        before = module.q4x8_linear(x, *w)
        assert release_thread_pool() is True
        after_here = module.q4x8_linear(x, *w)  # a new pool on this thread
        elsewhere: list[torch.Tensor] = []
        worker = threading.Thread(
            target=lambda: elsewhere.append(module.q4x8_linear(x, *w)))
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)  # the rest of the session keeps its own
    assert torch.equal(before, after_here)
    assert torch.equal(before, elsewhere[0])
    assert release_thread_pool() is True  # again, with the new pool in place
