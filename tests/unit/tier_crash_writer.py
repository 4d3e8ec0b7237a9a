"""Writer for the engine-level crash test of the disk tier (tests/unit/test_tier_crash.py).

Run as a fork server (`python tier_crash_writer.py`): it imports torch once, then for each
stdin line `FOLDER RECORDS NAMESPACE LAYOUT_FILE` forks a child that opens a `DiskTier` on
FOLDER with the engine's namespace and layout, prints `ready PID`, and puts the records
saved in RECORDS (`torch.save` of a list of dicts, as an engine demoted them) one by one,
over and over, until it is killed. When the child ends the server prints `exited PID`.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import torch

from flare.state.disk_tier import DiskTier, StateRecord


def run_child(folder: str, records_file: str, namespace: str, layout_file: str) -> None:
    layout = open(layout_file).read()
    records = [StateRecord(**r) for r in torch.load(records_file)]
    tier = DiskTier(folder, namespace, layout, 1 << 30)
    os.write(1, f"ready {os.getpid()}\n".encode())
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        for rec in records:
            tier.put(rec)
        for rec in records:  # write them again: the kill may land in any write
            tier.remove(rec.key)
    os._exit(3)


def serve() -> None:
    for line in sys.stdin:
        folder, records_file, namespace, layout_file = line.split()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                run_child(folder, records_file, namespace, layout_file)
            except BaseException:
                traceback.print_exc()
            os._exit(4)
        os.waitpid(pid, 0)
        sys.stdout.write(f"exited {pid}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    serve()
