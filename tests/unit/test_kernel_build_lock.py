"""The kernel build lock: processes that start together on a fresh machine (the replicas
of `make cluster`) build one key once; the others wait and then load the first's build."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

# a child that holds the lock for `hold` seconds and, inside it, writes the "build" only
# when there is none yet; it prints whether it built or found the other's
CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from flare.kernels.build import build_lock
    final, hold = Path(sys.argv[1]), float(sys.argv[2])
    with build_lock(final):
        so = final / "module.so"
        if so.is_file():
            print("loaded", flush=True)
        else:
            time.sleep(hold)
            final.mkdir()
            so.write_text("built")
            print("built", flush=True)
""")


def test_two_processes_build_one_key_once(tmp_path):
    final = tmp_path / "kernels" / "flare_qgemm_0123456789abcdef"
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(final), "1.5"],
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = sorted(p.communicate(timeout=60)[0].strip() for p in procs)
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == ["built", "loaded"]
    assert time.monotonic() - start >= 1.5  # the second waited for the first's build
    assert (final / "module.so").read_text() == "built"
