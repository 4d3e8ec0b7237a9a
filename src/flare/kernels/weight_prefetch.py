"""Which prefetch hint the int8 kernels give their weights, from the model's size and the CPU's
last-level cache (LLC).

A decode step reads every weight once. The kernels prefetch the weights ahead of their reads
(qdot8.cpp, `weight_prefetch_nta`), either non-temporally (`_MM_HINT_NTA`) or into every
cache level (`_MM_HINT_T0`), and which is faster depends on whether the weights fit in the
LLC, so that the next step finds them there:

- they do not fit (a ~100 MB model on a Zen 4 EPYC with a 32 MiB L3): NTA keeps them from
  displacing what does stay (the KV cache, the activations); a step at batch 1 was
  1.10-1.12x faster with it;
- they fit (the same models on a Xeon whose VM reports a 480 MiB L3): NTA lines are not
  kept in L2 and L3, so every step reads the weights from memory again; a step at batch 1
  was 2.5-2.7x slower with it, at 8 sequences 1.5x (`bench/ab_builds.py`, 2 threads).

So `non_temporal` asks for NTA only when the weights are larger than the LLC: a wrong NTA
costs far more than a wrong T0. Where sysfs does not tell the LLC's size, T0. The hint
changes no value (a prefetch never does), so this chooses speed only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CACHE_SYSFS = Path("/sys/devices/system/cpu/cpu0/cache")
_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_cache_size(text: str) -> int:
    """Bytes in a sysfs cache `size` ("491520K", "32M", "1024"). Raises ValueError on
    anything else."""
    text = text.strip()
    unit = _UNITS.get(text[-1:].upper(), 1) if text else 1
    digits = text[:-1] if text[-1:].upper() in _UNITS else text
    if not digits.isdigit():
        raise ValueError(f"not a cache size: {text!r}")
    return int(digits) * unit


def last_level_cache_bytes(root: Path = CACHE_SYSFS) -> int | None:
    """The size in bytes of the highest-level data or unified cache sysfs lists under
    `root` (cpu0's caches), or None where it lists none."""
    best: tuple[int, int] | None = None  # (level, bytes)
    for index in sorted(root.glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = parse_cache_size((index / "size").read_text())
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, size)
    return None if best is None else best[1]


def non_temporal(weight_bytes: int, llc_bytes: int | None) -> bool:
    """Whether weights of `weight_bytes` bytes, streamed once a decode step, should be
    prefetched non-temporally on a CPU whose LLC holds `llc_bytes` (None: unknown): only
    when they cannot fit in it."""
    return llc_bytes is not None and weight_bytes > llc_bytes


def apply(module: ModuleType, weight_bytes: int) -> bool:
    """Sets `module`'s weight prefetch hint (`set_weight_prefetch_nta`) for a model that
    streams `weight_bytes` bytes of weights a step, and returns whether it is now
    non-temporal (False for a build without the setter, which prefetches into L1). The
    hint is the module's, one for the process: the model loaded last sets it."""
    if not hasattr(module, "set_weight_prefetch_nta"):
        return False
    llc = last_level_cache_bytes()
    nta = non_temporal(weight_bytes, llc)
    module.set_weight_prefetch_nta(nta)
    log.debug("weights %.1f MiB, LLC %s bytes: %s weight prefetch", weight_bytes / 2**20,
              llc, "non-temporal" if nta else "T0")
    return nta
