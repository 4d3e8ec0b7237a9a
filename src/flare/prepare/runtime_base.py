"""The resident memory a serving process holds before any package is loaded.

Python, torch (with MKL and oneDNN), transformers' tokenizers, FastAPI and uvicorn take a
few hundred MiB of RSS of their own: a memory report that leaves them out understates
the serving process on CPU, where host memory is the device. `runtime_base_bytes`
measures them once per process in a fresh interpreter that imports what `flare serve`
imports and reads its own VmRSS (/proc/self/status; `ru_maxrss` elsewhere).
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys

log = logging.getLogger(__name__)

# what `flare serve` imports before it loads a package
_PROBE = """
import flare.server.app, flare.runtime.engine, flare.prepare.package  # noqa: F401
try:
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
except OSError:
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
print(rss)
"""
PROBE_TIMEOUT_S = 120.0


@functools.cache
def runtime_base_bytes() -> int:
    """RSS in bytes of a fresh interpreter that has imported Flare's serving modules (and
    so torch, transformers, FastAPI). Measured once per process; 0 (with a warning) when
    the probe fails, so a package can still be written."""
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                             timeout=PROBE_TIMEOUT_S, check=True)
        return int(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        log.warning("could not measure the serving runtime's base memory (%s); the memory "
                    "report leaves it out", exc)
        return 0
