"""Two builds of one int8 weight kernel side by side in one process: time per call.

`bench/ab_builds.py` judges a kernel change on whole decode steps; this one isolates one
kernel (q8x8_linear, q6kx8_linear, q4x8_linear or q5x8_linear as Q5_0) on one weight
shape, so a change to it shows at every row count of x, from decode's 1 row to a prompt's
512. The two builds' calls alternate round after round (the machine's speed drifts by
more than most kernel changes within minutes, so two runs apart do not compare); each
prints its minimum microseconds a call over the rounds, the speed-up old / new, the
integer rate (2 B N K operations a call, GOP/s), the weight bytes read a second (GB/s)
and whether the two builds' outputs are bit-identical. A figure, not pass/fail.

    PYTHONPATH=src .venv/bin/python bench/kernel_ab.py OLD.so NEW.so [--kinds q8,q6,q4,q5]
        [--rows 1,8,128,512] [--shapes 1536x768,768x1536] [--cold | --hot] [--rounds 7]
        [--threads 2]

`--cold` (the default) cycles through 48 copies of the weights, more bytes than a
32 MiB L3 holds, so each call streams its weights from memory as decode does; `--hot`
reuses one copy (in cache), which isolates the arithmetic. The weights are random codes
in each format's range (`flare.kernels.probe.problem` draws the same kinds); the layout
does not change the time. Shapes (N x K): by default 1536 x 768 and 768 x 1536 (K a
multiple of 256, as Q6_K needs); the embedded model's own MLP is 1536 x 576 and 576 x
1536, the shapes its Q4_K_M file stores as Q5_0.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from flare.kernels.probe import import_extension, same_bytes

COLD_COPIES = 48


def weights(kind: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One random weight of `kind` [n, k] as the kernel's arguments after x."""
    nb = k // 32

    def half(cols: int) -> torch.Tensor:
        return (torch.randn(n, cols, generator=g) * 0.01).half()

    if kind == "q8":
        return (torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), half(nb))
    if kind == "q6":
        return (torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8),
                torch.randint(-128, 128, (n, k // 16), generator=g, dtype=torch.int8),
                half(k // 256))
    if kind == "q4":
        return (torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
                half(nb), half(nb))
    if kind == "q5":  # Q5_0: no mins held (an empty [n, 0] part)
        return (torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
                torch.randint(0, 256, (n, k // 8), generator=g, dtype=torch.uint8),
                half(nb), torch.empty(n, 0, dtype=torch.half))
    raise SystemExit(f"--kinds: unknown kind {kind!r} (q8, q6, q4, q5)")


KERNEL = {"q8": "q8x8_linear", "q6": "q6kx8_linear", "q4": "q4x8_linear",
          "q5": "q5x8_linear"}


def time_calls(call: Callable[[tuple], torch.Tensor], copies: list[tuple]) -> float:
    """Seconds a call, the mean over one pass through every copy."""
    start = time.perf_counter()
    for w in copies:
        call(w)
    return (time.perf_counter() - start) / len(copies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs=2, type=Path, help="two kernel module .so files")
    ap.add_argument("--kinds", default="q8,q6,q4")
    ap.add_argument("--rows", default="1,8,128,512")
    ap.add_argument("--shapes", default="1536x768,768x1536", help="N x K, comma-separated")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cold", dest="cold", action="store_true", default=True)
    mode.add_argument("--hot", dest="cold", action="store_false")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if len({p.name.split(".")[0] for p in args.builds}) < 2:
        raise SystemExit("the two builds have one module name: Python would load it once")
    torch.set_num_threads(args.threads)
    old, new = (import_extension(p) for p in args.builds)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    g = torch.Generator().manual_seed(0)
    print(f"{'cold' if args.cold else 'hot'} weights, {args.threads} threads, "
          f"min over {args.rounds} rounds; old = {args.builds[0].name}, "
          f"new = {args.builds[1].name}")
    print(f"{'kernel':<14}{'N x K':>12}{'B':>6}{'old us':>10}{'new us':>10}"
          f"{'speed-up':>10}{'new GOP/s':>11}{'new GB/s':>10}  same bits")
    for kind in args.kinds.split(","):
        for n, k in shapes:
            copies = [weights(kind, n, k, g)
                      for _ in range(COLD_COPIES if args.cold else 1)]
            for b in rows:
                x = torch.randn(b, k, generator=g)
                fns = [lambda w, m=m: getattr(m, KERNEL[kind])(x, *w) for m in (old, new)]
                same = same_bytes(fns[0](copies[0]), fns[1](copies[0]))
                # enough calls a round for ~20 ms of work, at least one pass
                t0 = time_calls(fns[1], copies)
                passes = max(1, int(0.02 / (t0 * len(copies))))
                best = [float("inf"), float("inf")]
                for r in range(args.rounds):
                    for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                        t = min(time_calls(fns[i], copies) for _ in range(passes))
                        best[i] = min(best[i], t)
                gops = 2 * b * n * k / best[1] / 1e9
                gbs = sum(t.numel() * t.element_size() for t in copies[0]) / best[1] / 1e9
                print(f"{KERNEL[kind]:<14}{f'{n}x{k}':>12}{b:>6}{best[0] * 1e6:>10.1f}"
                      f"{best[1] * 1e6:>10.1f}{best[0] / best[1]:>9.2f}x{gops:>11.0f}"
                      f"{gbs:>10.1f}  "
                      f"{'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
