"""The register width of the AVX-512 int8 kernels at few rows of x, measured on this CPU.

The AVX-512 builds (kernel variants avx512vnni and avx512amx) can run a pass over the
8-row interleaved weights one group a ymm register (Y8) or two adjacent groups a zmm
register (Z16). Both give the same bits (qdot8.cpp), so the choice is speed only, and it
differs by CPU where decode streams its weights from memory at 1-4 rows of x: on a Xeon
with AMX, Z16 was 1.04-1.21x faster a decode step at 1, 2 and 4 sequences; on a Zen 4
EPYC, Y8 was 1.28x (1 sequence), 1.18x (2) and 1.10x (4) faster (`bench/ab_builds.py`,
2 threads). So it is measured here, once per build and machine, not guessed from the
CPU's name:

`zmm_min_rows(module, record, key)` times `q4x8_linear` over `WEIGHT_BYTES` of weights in
layer-sized matrices (more than a server CPU's L3 holds, so they come from memory as a
decode step's do) at each of `ROW_COUNTS` rows of x, the two widths back to
back for `ROUNDS` rounds (the median ratio of their times kept), and takes the smallest
row count from which Z16 keeps up at every measured count (within `MARGIN`: Y8 must win
clearly to be chosen). On the Zen 4 (2 threads), five fresh processes measured Z16 / Y8
at 1.18-1.46 for 1 and 2 rows, 0.93-1.10 for 4 (a near tie: either answer costs little)
and 0.75-0.86 for 8, so they chose 8 or 4. The answer is kept in the JSON file `record`
(beside the module: `<module folder>.width.json`) under the build's key, so a later
process reads it in microseconds; `flare.kernels.qgemm()` applies it with the module's
`set_zmm_min_rows`. Builds without AVX-512 have no Z16 and skip all this.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path
from types import ModuleType

import torch

from flare.atomic_file import write_text_atomic

log = logging.getLogger(__name__)

ROW_COUNTS = (1, 2, 4, 8)  # decode batches the choice is made for
ABOVE_ALL = 16  # zmm_min_rows when Y8 wins at every measured count (Z16 from 16 rows)
# Matrices of 2,048 x 1,024 q4 weights (1 MiB of codes each, a mid-sized model's layer
# linear): 153 of them, 192 MiB with their scales and mins. 45 MiB was more than a Zen 4's
# 32 MiB L3, but a Xeon (480 MiB of L3 as its VM reports it) held it: q4x8 read 48 GB/s
# at one row, against 28 at 150 MiB and 22 at 800, and Z16 / Y8 came out 1.03-1.09 at one
# row, choosing Y8, while whole decode steps of ~100 MB models were faster with Z16
# (1.06x embedded, 1.10x Q4_K_M, 1.16x Q6_K at batch 1). At 96 MiB it measured 0.97, at
# 192 MiB 0.90 (about 2 s on 2 threads, once per build and machine).
SHAPE = (2048, 1024)
WEIGHT_BYTES = 192 << 20
ROUNDS = 15
WARM_UP_S = 0.4
MARGIN = 0.02  # Y8 is chosen at a row count only when at least 2% faster there


def _matrices(count: int, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """`count` random q4x8 weights of SHAPE: (codes uint8 [N, K/2], scales, mins float16
    [N, K/32]) each, codes any byte, scales and mins small."""
    n, k = SHAPE
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8),
             (torch.rand(n, k // 32, generator=g) * 0.01).half(),
             (torch.rand(n, k // 32, generator=g) * -0.01).half())
            for _ in range(count)]


def measure(module: ModuleType, rounds: int = ROUNDS) -> dict[int, float]:
    """How much slower Z16 is than Y8 at each row count of x: {rows: the median over
    `rounds` rounds of (seconds of a Z16 pass) / (seconds of a Y8 pass)}, a pass being
    `q4x8_linear` over every matrix. The two passes of a round run back to back (in
    turns first), so a slow spell of a shared machine slows both: their ratio is steadier
    than either time. (Row counts measured one after another instead of within each round
    gave a fresh process 0.98-1.04 at one row once, against 1.2-1.4 usually.) Leaves the
    module's zmm_min_rows as it found it."""
    n, k = SHAPE
    bytes_each = n * k // 2 + 2 * 2 * n * (k // 32)
    weights = _matrices(max(1, WEIGHT_BYTES // bytes_each))
    before = module.zmm_min_rows()

    def seconds(x: torch.Tensor, zmm_from: int) -> float:
        module.set_zmm_min_rows(zmm_from)
        t0 = time.perf_counter()
        for w in weights:
            module.q4x8_linear(x, *w)
        return time.perf_counter() - t0

    xs = {rows: torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
          for rows in ROW_COUNTS}
    try:
        # warm-up: the weights' pages, the thread pool, the clock
        t_end = time.perf_counter() + WARM_UP_S
        while time.perf_counter() < t_end:
            for rows, x in xs.items():
                seconds(x, 1), seconds(x, rows + 1)
        # rounds outside, row counts inside: a slow spell of the machine falls on every
        # row count alike, and the median drops it
        each: dict[int, list[float]] = {rows: [] for rows in xs}
        for r in range(rounds):
            for rows, x in xs.items():
                if r % 2:
                    ymm = seconds(x, rows + 1)
                    zmm = seconds(x, 1)
                else:
                    zmm = seconds(x, 1)
                    ymm = seconds(x, rows + 1)
                each[rows].append(zmm / ymm)
        ratios = {rows: statistics.median(q) for rows, q in each.items()}
    finally:
        module.set_zmm_min_rows(before)
    return ratios


def choose(ratios: dict[int, float], margin: float = MARGIN) -> int:
    """The smallest measured row count such that Y8 is not `margin` faster than Z16 there
    (a Z16 / Y8 time ratio above 1 / (1 - margin)) nor at any measured count above it;
    ABOVE_ALL when Y8 wins at the largest. `ratios` as `measure` returns them."""
    choice = ABOVE_ALL
    for rows in sorted(ratios, reverse=True):
        if ratios[rows] * (1 - margin) > 1:
            break
        choice = rows
    return choice


def zmm_min_rows(module: ModuleType, record: Path, key: str) -> int:
    """The rows of x from which `module` (an AVX-512 build, key `key`) should take Z16 on
    this machine: read from the JSON file `record` when it was measured for `key` over
    `WEIGHT_BYTES`, else measured (`measure`, about 2 s) and saved there. A record that
    cannot be written only makes the next process measure again.

    Raises:
        AttributeError: the module has no `set_zmm_min_rows` (a build older than it).
    """
    try:
        saved = json.loads(record.read_text())
        if (saved.get("key") == key and saved.get("weight_bytes") == WEIGHT_BYTES
                and int(saved["zmm_min_rows"]) >= 1):
            return int(saved["zmm_min_rows"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    ratios = measure(module)
    rows = choose(ratios)
    log.info("Flare's int8 kernels: two groups a zmm register from %d rows of x on "
             "(Z16 / Y8 time at each row count: %s)", rows, ratios)
    try:
        write_text_atomic(record, json.dumps({
            "key": key, "weight_bytes": WEIGHT_BYTES, "zmm_min_rows": rows,
            "zmm_over_ymm": {str(r): round(q, 4) for r, q in ratios.items()}}) + "\n")
    except OSError:
        pass
    return rows
