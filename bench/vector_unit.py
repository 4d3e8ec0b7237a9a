"""What bounds the int8 kernels at a few rows of x: this core's 512-bit vector throughput.

The AVX-512 kernels (qdot8.cpp, Z16) spend, per row of x, block of 32 along K and 16
weight rows, 8 `vpdpbusd` (the block's integer sums), an add of its two chains and 4
float32 ops (convert, the scale product, two FMAs for the scale and min terms, `q4_term`). At 8 rows of x (decode
of 8 streams) that is the kernel's whole inner loop, so its ceiling is how fast this core
retires that mix. This compiles a small C++ timing loop with g++ (AVX-512 VNNI) and
prints, in ns and in core cycles (a dependent `vpaddd` chain is one cycle a step):

- `vpdpbusd` zmm alone and FMA zmm alone (12 independent chains: throughput, not latency);
- the kernel's mix at 8 rows: per row-block two fresh chains of 4 `vpdpbusd` (x's codes
  broadcast from memory), their add, a convert, the scale product and two FMAs;
- the int8 rate that mix allows (2 x 32 x 16 ops a row-block) against `vpdpbusd` alone;
- Flare's own `q4x8_linear` at 8 rows of x on one thread, in cache (the embedded model's
  gate/up shape, 3072 x 576), as a share of that rate, where Flare's kernels run here.

On the 2-core Xeon (family 6 model 167, 3.7 GHz) `vpdpbusd` and FMA each ran at about 2 a
cycle, and the row-block's 13 ops took 8 cycles: 0.55 of the `vpdpbusd`-only rate, about
475 GOP/s a core. The codes' unpacking and the block scales, shared by the 8 rows, add
about 2.5 ops a row-block more; q4x8 at 8 rows in cache ran 323-349 GOP/s on one thread,
67-73% of the mix's rate. A figure, not
pass/fail; needs g++ and a CPU with avx512_vnni (else it says so and exits).

    PYTHONPATH=src .venv/bin/python bench/vector_unit.py [--iterations 20000000]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from machine_limits import best_rate

from flare import kernels

SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>

// one asm statement an instruction, so the compiler keeps each and its registers
#define DP(a) asm volatile("vpdpbusd %1, %2, %0" : "+v"(a) : "v"(u), "v"(s))
#define FMA(f) asm volatile("vfmadd231ps %1, %2, %0" : "+v"(f) : "v"(g), "v"(g))
#define CVT(f, i) asm volatile("vcvtdq2ps %1, %0" : "=v"(f) : "v"(i))
#define MUL(f) asm volatile("vmulps %1, %2, %0" : "=v"(f) : "v"(g), "v"(g))

int main(int argc, char** argv) {
  const long n = std::atol(argv[1]);
  const __m512i u = _mm512_set1_epi32(0x01010101), s = _mm512_set1_epi32(0x02020202);
  const __m512 g = _mm512_set1_ps(1.0f);
  __m512i a0 = u, a1 = u, a2 = u, a3 = u, a4 = u, a5 = u, a6 = u, a7 = u, a8 = u, a9 = u,
          a10 = u, a11 = u;
  __m512 f0 = g, f1 = g, f2 = g, f3 = g, f4 = g, f5 = g, f6 = g, f7 = g, f8 = g, f9 = g,
         f10 = g, f11 = g, c0 = g, c1 = g, m0 = g, m1 = g;
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  for (long i = 0; i < n; ++i) asm volatile("vpaddd %1, %0, %0" : "+v"(a0) : "v"(u));
  const auto t1 = clock::now();
  for (long i = 0; i < n / 12; ++i) {
    DP(a0); DP(a1); DP(a2); DP(a3); DP(a4); DP(a5);
    DP(a6); DP(a7); DP(a8); DP(a9); DP(a10); DP(a11);
  }
  const auto t2 = clock::now();
  for (long i = 0; i < n / 12; ++i) {
    FMA(f0); FMA(f1); FMA(f2); FMA(f3); FMA(f4); FMA(f5);
    FMA(f6); FMA(f7); FMA(f8); FMA(f9); FMA(f10); FMA(f11);
  }
  const auto t3 = clock::now();
  // 8 rows of x against one block of 16 weight rows, as the kernel's inner loop runs them:
  // each row two fresh chains of 4 vpdpbusd (x's codes broadcast from memory), their add,
  // the convert, the scale product and two FMAs into the row's own accumulator
  alignas(64) static int xq[64];
  alignas(64) static float xd[8], xs[8];
  const __m512i w0 = u, w1 = s, w2 = u, w3 = s, w4 = u, w5 = s, w6 = u, w7 = s;
  const __m512 d8 = g, m8 = g;
#define DPB(a, w, k) \
  asm volatile("vpdpbusd %1%{1to16%}, %2, %0" : "+v"(a) : "m"(xq[k]), "v"(w))
#define ROW(acc, r)                                                                  \
  {                                                                                  \
    __m512i z0, z1;                                                                  \
    __m512 p, dd;                                                                    \
    asm volatile("vpxord %0, %0, %0" : "=v"(z0));                                    \
    asm volatile("vpxord %0, %0, %0" : "=v"(z1));                                    \
    DPB(z0, w0, 8 * r); DPB(z1, w1, 8 * r + 1); DPB(z0, w2, 8 * r + 2);              \
    DPB(z1, w3, 8 * r + 3); DPB(z0, w4, 8 * r + 4); DPB(z1, w5, 8 * r + 5);          \
    DPB(z0, w6, 8 * r + 6); DPB(z1, w7, 8 * r + 7);                                  \
    asm volatile("vpaddd %1, %0, %0" : "+v"(z0) : "v"(z1));                          \
    CVT(p, z0);                                                                      \
    asm volatile("vmulps %1%{1to16%}, %2, %0" : "=v"(dd) : "m"(xd[r]), "v"(d8));     \
    asm volatile("vfmadd231ps %1, %2, %0" : "+v"(acc) : "v"(dd), "v"(p));            \
    asm volatile("vfmadd231ps %1%{1to16%}, %2, %0" : "+v"(acc) : "m"(xs[r]), "v"(m8)); \
  }
  for (long i = 0; i < n / 12; ++i) {
    ROW(f0, 0) ROW(f1, 1) ROW(f2, 2) ROW(f3, 3) ROW(f4, 4) ROW(f5, 5) ROW(f6, 6) ROW(f7, 7)
  }
  const auto t4 = clock::now();
  const auto ns = [](auto d) { return std::chrono::duration<double, std::nano>(d).count(); };
  std::printf("%.5f %.5f %.5f %.5f\n", ns(t1 - t0) / n, ns(t2 - t1) / (n / 12 * 12),
              ns(t3 - t2) / (n / 12 * 12), ns(t4 - t3) / (n / 12 * 8));
  volatile float sink = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(f0, f3), c0));
  (void)sink;
  return 0;
}
"""


def cpu_has(flag: str) -> bool:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return flag in line.split()
    except OSError:
        pass
    return False


def q4_kernel_gops(rows: int = 8, n: int = 3072, k: int = 576) -> float | str:
    """GOP/s of Flare's q4x8_linear on `rows` rows of x against an n x k weight (in cache),
    on one thread; or why the kernels cannot run here."""
    problem = kernels.qgemm_problem()
    if problem is not None:
        return problem
    from flare.models.quant.blocks import quantize_q4
    from flare.models.quant.interleaved import Q4x8Weight

    g = torch.Generator().manual_seed(0)
    w = Q4x8Weight.pack(quantize_q4(torch.randn(n, k, generator=g)))
    x = torch.randn(rows, k, generator=g)
    ops = kernels.qgemm()
    torch.set_num_threads(1)
    return best_rate(2 * rows * n * k / 1e9,
                     lambda: ops.q4x8_linear(x, w.codes, w.scales, w.mins))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=20_000_000)
    args = ap.parse_args()
    if not cpu_has("avx512_vnni"):
        raise SystemExit("vector_unit: this CPU lists no avx512_vnni; nothing to measure")
    if shutil.which("g++") is None:
        raise SystemExit("vector_unit: needs g++")
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "unit.cpp", Path(tmp) / "unit"
        src.write_text(SOURCE)
        subprocess.run(["g++", "-O2", "-mavx512f", "-mavx512vnni", str(src), "-o", str(exe)],
                       check=True)
        runs = [[float(v) for v in subprocess.run([str(exe), str(args.iterations)],
                                                  capture_output=True, text=True,
                                                  check=True).stdout.split()]
                for _ in range(3)]
    cycle, dp, fma, mix = (min(r[i] for r in runs) for i in range(4))  # ns each

    def show(ns: float) -> str:
        return f"{ns / cycle:.2f} cycles, {ns:.3f} ns"

    print(f"core clock {1 / cycle:.2f} GHz (a dependent vpaddd chain: {cycle:.3f} ns a step)")
    print(f"vpdpbusd zmm: {show(dp)} each")
    print(f"vfmadd231ps zmm: {show(fma)} each")
    print(f"a row-block (8 vpdpbusd, an add, convert, multiply, 2 FMAs): {show(mix)}; "
          f"{dp * 8 / mix:.2f} of the vpdpbusd-only rate (8 / 13 = 0.62 if every op "
          f"takes a vpdpbusd's slot)")
    ceiling = 2 * 32 * 16 / mix
    print(f"int8 rate of that mix, one core: {ceiling:.0f} GOP/s "
          f"(vpdpbusd alone: {2 * 64 / dp:.0f})")
    kernel = q4_kernel_gops()
    if isinstance(kernel, str):
        print(f"q4x8_linear: not measured ({kernel})")
    else:
        print(f"q4x8_linear, 8 rows x 3072 x 576, one thread, in cache: {kernel:.0f} GOP/s, "
              f"{100 * kernel / ceiling:.0f}% of the mix's rate (the rest: the codes' "
              f"unpacking and block scales, shared by the 8 rows, and the loop)")

if __name__ == "__main__":
    main()
