"""Which prefetch hint the int8 kernels give their weights, from the CPU's vendor, the model's
size and the last-level cache (LLC).

A decode step reads every weight once. The kernels prefetch the weights ahead of their reads
(qdot8.cpp, `weight_prefetch_nta`), either non-temporally (`_MM_HINT_NTA`) or into every
cache level (`_MM_HINT_T0`). Measured (2 threads):

- AMD Zen 4 EPYC (32 MiB L3), ~100 MB models that cannot stay in it: NTA keeps them from
  displacing what does stay (the KV cache, the activations); a step at batch 1 was
  1.10-1.12x faster with it, at 8 sequences 1.03-1.05x (`bench/ab_builds.py`).
- Intel Xeon (480 MiB of L3 as its VM reports it): NTA was slower at every size, as an
  Intel core fetches NTA lines into L1 alone. Whole steps of the same models: 2.5-2.7x
  slower at batch 1, 1.5x at 8 sequences. `q4x8_linear` alone over 150 MiB of weights:
  28.0 against 21.4 GB/s at one row of x (T0 against NTA), 18.9 against 11.7 at 8 rows;
  over 800 MiB, more than the LLC: 21.7 against 18.3, and 15.9 against 9.6.

So `non_temporal` asks for NTA only on an AMD CPU (vendor "AuthenticAMD") and for weights
larger than its LLC; anywhere else, or where /proc/cpuinfo or sysfs do not say, T0. The
hint changes no value (a prefetch never does), so this chooses speed only.
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


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The first `vendor_id` in `cpuinfo` ("GenuineIntel", "AuthenticAMD"), or None where
    there is none or the file cannot be read."""
    try:
        with cpuinfo.open() as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip() or None
    except OSError:
        pass
    return None


def non_temporal(weight_bytes: int, llc_bytes: int | None, vendor: str | None) -> bool:
    """Whether weights of `weight_bytes` bytes, streamed once a decode step, should be
    prefetched non-temporally on a CPU of `vendor` whose LLC holds `llc_bytes` (None:
    unknown): only on AMD, and only when they cannot fit in the LLC."""
    return vendor == "AuthenticAMD" and llc_bytes is not None and weight_bytes > llc_bytes


def apply(module: ModuleType, weight_bytes: int) -> bool:
    """Sets `module`'s weight prefetch hint (`set_weight_prefetch_nta`) for a model that
    streams `weight_bytes` bytes of weights a step, and returns whether it is now
    non-temporal (False for a build without the setter, which prefetches into L1). The
    hint is the module's, one for the process: the model loaded last sets it."""
    if not hasattr(module, "set_weight_prefetch_nta"):
        return False
    llc, vendor = last_level_cache_bytes(), cpu_vendor()
    nta = non_temporal(weight_bytes, llc, vendor)
    module.set_weight_prefetch_nta(nta)
    log.debug("weights %.1f MiB, %s LLC %s bytes: %s weight prefetch", weight_bytes / 2**20,
              vendor, llc, "non-temporal" if nta else "T0")
    return nta
