"""Whether a decode step's weights come from the last-level cache or from memory here.

A decode step reads every weight once, then again one step later: what lies between two
reads of the same weight is the rest of the step's weights. This times the embedded
model's output layer (a `q8x8` weight of 49,152 x 576, about 30 MB, as its lm_head is
held) on 8 rows of x right after a first call, then with X MB of other int8 weights (the
gate/up shape 3,072 x 576 in `q4x8`, 1.1 MB each, run on the same 8 rows) between the two
calls, and after a 512 MiB buffer is written instead (its weights then come from memory).
If the time after X MB stays at the time after none, the cache held the output layer
across X MB of other weights, and a step of a model that size reads its weights from it.

On the 2-core Xeon (480 MiB of L3 as its VM reports it) the output layer took 0.69-0.82 ms
after 0 to 220 MB of other weights and 1.08-1.23 ms after the 512 MiB write: the embedded
model's ~95 MB of weights and its K/V stay in L3 from step to step, so decode there is
bound by the cores' L3 bandwidth and their arithmetic, not by memory's. A figure, not
pass/fail.

    PYTHONPATH=src .venv/bin/python bench/cache_reach.py [--between 0,66,120,220]
        [--rounds 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from kernel_ab import weights

from flare import kernels

EVICT_BYTES = 512 << 20
OTHER_SHAPE = (3072, 576)  # the embedded model's gate/up projection
LM_HEAD_SHAPE = (49152, 576)  # its output layer


def nbytes(parts: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--between", default="0,66,120,220",
                    help="MB of other weights run between the two calls, comma-separated")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    problem = kernels.qgemm_problem()
    if problem is not None:
        raise SystemExit(f"cache_reach: Flare's int8 kernels cannot run here ({problem})")
    torch.set_num_threads(args.threads)
    ops = kernels.qgemm()
    g = torch.Generator().manual_seed(0)
    lm_head = weights("q8", *LM_HEAD_SHAPE, g)
    between = [float(v) for v in args.between.split(",")]
    one = nbytes(weights("q4", *OTHER_SHAPE, g)) / 1e6
    others = [weights("q4", *OTHER_SHAPE, g) for _ in range(int(max(between) / one))]
    evict = torch.ones(EVICT_BYTES, dtype=torch.uint8)
    x = torch.randn(8, LM_HEAD_SHAPE[1], generator=g)

    def lm_head_ms() -> float:
        t = time.perf_counter()
        ops.q8x8_linear(x, *lm_head)
        return 1e3 * (time.perf_counter() - t)

    cases: dict[str, list[float]] = {f"after {mb:g} MB of other weights": [] for mb in between}
    cases["after a 512 MiB write (from memory)"] = []
    for _ in range(args.rounds):
        for mb, times in zip(between, cases.values()):
            lm_head_ms()
            for w in others[:int(mb / one)]:
                ops.q4x8_linear(x, *w)
            times.append(lm_head_ms())
        evict.add_(1)
        cases["after a 512 MiB write (from memory)"].append(lm_head_ms())
    print(f"output layer q8x8 {LM_HEAD_SHAPE[0]} x {LM_HEAD_SHAPE[1]} ({nbytes(lm_head) / 1e6:.1f} "
          f"MB) on 8 rows, {args.threads} threads, {args.rounds} rounds; other weights "
          f"q4x8 {OTHER_SHAPE[0]} x {OTHER_SHAPE[1]}, {one:.2f} MB each")
    for name, times in cases.items():
        print(f"{name:<40} {min(times):.3f} ms min, {statistics.median(times):.3f} median")


if __name__ == "__main__":
    main()
