"""This machine's limits, measured: what a benchmark's figures are shares of.

- memory: copy and read bandwidth over a buffer far larger than the caches (decode reads
  every weight once a step, so its ceiling is bytes/s);
- fp32 peak: torch.mm on cache-resident matrices (512^3, 3 MiB in all), so the figure is
  the arithmetic's, not memory's;
- int8 kernel peak: the faster of Flare's own `q8x8_linear` and `q4x8_linear` (int8
  activations x 8- or 4-bit codes, the dot products the int8 formats run) on a
  cache-resident product of the embedded model's gate/up shape (256 x 1536 x 576,
  activation quantization included, as every call pays it). q4x8's nibble codes take 8
  rows of x a pass in the AVX-512 variant, q8x8's bytes 4, so q4x8 is the faster there
  (Zen 5, 2 threads: about 1,100 against 790 GOP/s); a peak from q8x8 alone put prefill
  above 100% of it;

each at 1 thread and at the thread count the benchmark runs with, with the CPU's model
name, its instruction-set flags and the kernel variant Flare chose (where
`flare.kernels` says which). Peaks are the best of a few timed rounds.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from flare import kernels

FP32_SHAPE = 512  # n of the n x n x n torch.mm: 3 MiB of operands, cache-resident
INT8_SHAPE = (256, 1536, 576)  # (rows of x, output rows N, K) of the int8 products


def cpu_model() -> str:
    """The `model name` line of /proc/cpuinfo, else `platform.processor()`."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def isa_flags(flags: frozenset[str] | None) -> list[str]:
    """The flags of `flags` (/proc/cpuinfo's) that say which kernels can run: fma, avx2,
    every avx512*, every *vnni*, every amx*; sorted. [] for None (unreadable)."""
    return sorted(f for f in flags or ()
                  if f in ("fma", "avx2") or f.startswith(("avx512", "amx")) or "vnni" in f)


def kernel_variant() -> str:
    """The kernel variant Flare runs here (`flare.kernels.isa_variant()`), or why none
    can be had (a bench line, never a crash)."""
    try:
        return kernels.isa_variant()
    except (RuntimeError, OSError) as exc:
        return f"isa_variant() raised {type(exc).__name__}: {exc}"


def best_rate(work: float, call: Callable[[], object], min_s: float = 0.1,
              rounds: int = 5) -> float:
    """`work` units per second of `call` at its best: `rounds` rounds, each timing as
    many calls as fill `min_s` seconds (one warm-up call first)."""
    call()
    t = time.perf_counter()
    call()
    reps = max(1, int(min_s / max(time.perf_counter() - t, 1e-9)))
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, (time.perf_counter() - t) / reps)
    return work / best


def at_threads(threads: int, measure: Callable[[], float]) -> float:
    """`measure()` with torch (and so Flare's kernels, on torch's pool) at `threads`."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return measure()
    finally:
        torch.set_num_threads(before)


def fp32_peak_gflops() -> float:
    """fp32 GFLOP/s of torch.mm on FP32_SHAPE^3 float32 matrices, at torch's threads."""
    n = FP32_SHAPE
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return best_rate(2 * n ** 3 / 1e9, lambda: torch.mm(a, b, out=out))


def int8_kernel_peak_gops() -> float | str:
    """GOP/s (a multiply-add is 2) of the faster of Flare's q8x8_linear and q4x8_linear
    on an INT8_SHAPE product, at torch's threads; or why the kernels cannot run here."""
    problem = kernels.qgemm_problem()
    if problem is not None:
        return problem
    from flare.models.quant.blocks import quantize_q4, quantize_q8
    from flare.models.quant.interleaved import Q4x8Weight, Q8x8Weight

    b, n, k = INT8_SHAPE
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g)
    q8, q4 = Q8x8Weight.pack(quantize_q8(w)), Q4x8Weight.pack(quantize_q4(w))
    x = torch.randn(b, k, generator=g)
    ops = kernels.qgemm()
    calls = (lambda: ops.q8x8_linear(x, q8.codes, q8.scales),
             lambda: ops.q4x8_linear(x, q4.codes, q4.scales, q4.mins))
    return max(best_rate(2 * b * n * k / 1e9, call) for call in calls)


def bandwidth_gbs(nbytes: int = 256 << 20, reps: int = 5) -> tuple[float, float]:
    """(copy, read) GB/s over a buffer of `nbytes`: copy counts bytes read plus written
    (STREAM's convention), read is a sum over the buffer. Medians of `reps`."""
    src = torch.empty(nbytes // 4).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    copies, reads = [], []
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t)
        t = time.perf_counter()
        src.sum()
        reads.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(copies) / 1e9, nbytes / statistics.median(reads) / 1e9


@dataclass(frozen=True)
class Limits:
    """The machine's measured limits at `threads` (and at 1 thread, `*_1t`).

    Attributes: copy_gbs, read_gbs (GB/s); fp32_gflops, fp32_gflops_1t (GFLOP/s);
    int8_gops, int8_gops_1t (GOP/s, None when the kernels cannot run: `int8_problem`
    says why); cpu (model name); isa (the flags that matter); variant (Flare's kernels).
    """

    threads: int
    copy_gbs: float
    read_gbs: float
    fp32_gflops: float
    fp32_gflops_1t: float
    int8_gops: float | None
    int8_gops_1t: float | None
    int8_problem: str | None
    cpu: str
    isa: list[str]
    variant: str

    def lines(self) -> list[str]:
        """What was measured, for a report: the CPU, then the limits."""
        int8 = (f"int8 kernel peak {self.int8_gops_1t:.0f} / {self.int8_gops:.0f} GOP/s "
                f"(q8x8 / q4x8_linear, the faster, {'x'.join(map(str, INT8_SHAPE))})"
                if self.int8_gops is not None else f"int8 kernel peak: none ({self.int8_problem})")
        cpu = (f"cpu: {self.cpu}; flags: {' '.join(self.isa) or '(unreadable)'}; "
               f"kernel variant: {self.variant}")
        limits = (f"limits at 1 / {self.threads} threads: fp32 peak {self.fp32_gflops_1t:.0f} / "
                  f"{self.fp32_gflops:.0f} GFLOP/s (torch.mm {FP32_SHAPE}^3); {int8}; memory "
                  f"at {self.threads}: read {self.read_gbs:.1f} GB/s, copy "
                  f"{self.copy_gbs:.1f} GB/s (read+write)")
        return [cpu, limits]


def measure_limits(threads: int) -> Limits:
    """Every limit of `Limits`, measured now (a few seconds)."""
    int8 = at_threads(threads, int8_kernel_peak_gops)
    ok = not isinstance(int8, str)
    copy_gbs, read_gbs = at_threads(threads, bandwidth_gbs)
    return Limits(threads=threads, copy_gbs=copy_gbs, read_gbs=read_gbs,
                  fp32_gflops=at_threads(threads, fp32_peak_gflops),
                  fp32_gflops_1t=at_threads(1, fp32_peak_gflops),
                  int8_gops=int8 if ok else None,
                  int8_gops_1t=at_threads(1, int8_kernel_peak_gops) if ok else None,
                  int8_problem=None if ok else int8, cpu=cpu_model(),
                  isa=isa_flags(kernels.cpu_flags()), variant=kernel_variant())
