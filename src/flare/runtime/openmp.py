"""Handing the CPU kernels' OpenMP threads over from one Python thread to another.

Flare's kernels split their work with `at::parallel_for`, which runs on OpenMP (libgomp,
the copy torch loads). libgomp keeps a pool of worker threads per thread that starts
parallel regions, and counts the workers of every pool. When they outnumber the CPUs, it
cuts how long an idle worker spins before it sleeps from 300,000 iterations to 100 (GCC's
GOMP_SPINCOUNT documentation), so every later parallel region must wake its workers from
a futex.

`flare serve` builds the engine on the main thread (whose pool keeps its workers) and
steps it on the engine thread (a second pool). On 2 cores that is 4 threads to 2 CPUs, and
every kernel paid the wake-up. Measured on a 2-core Xeon: q4x8_linear at 8 rows of x took
63 us from the main thread and 150-200 us from a second thread; 78 us once the main
thread's pool was released. The engine's forward of one agent turn (19 new tokens on
2,338 cached) took 48 ms on the main thread and 103 ms on a second one.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

import torch  # noqa: F401  (loads the libgomp this module looks for)

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t (OpenMP 5.0, section 3.2.43): threads may go


@functools.cache
def _pause_resource_all() -> Callable[[int], int] | None:
    """libgomp's `omp_pause_resource_all` from the copy this process loaded (found in
    /proc/self/maps; a second copy loaded by name would hold its own pools), or None
    where there is none (not Linux, no OpenMP build of torch)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = sorted({line.split()[-1] for line in maps
                            if "libgomp" in line and "/" in line})
    except OSError:
        return None
    for path in paths:
        try:
            fn = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    return None


def release_thread_pool() -> bool:
    """Lets the calling thread's idle OpenMP workers exit (`omp_pause_resource_all` with
    omp_pause_soft), before another thread takes over the compute. A later parallel region
    on this thread builds a new pool; results never change.

    Returns:
        True when libgomp released them; False where it cannot be found or refused
        (nothing changes then).
    """
    fn = _pause_resource_all()
    if fn is None:
        return False
    ok = fn(OMP_PAUSE_SOFT) == 0
    if not ok:
        log.debug("omp_pause_resource_all refused")
    return ok
