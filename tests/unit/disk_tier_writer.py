"""Writer for the disk tier's crash test: deterministic records, written until killed.

Run as a *fork server* (`python disk_tier_writer.py`): it imports torch once, then for
each stdin line `FOLDER BUDGET SEED` forks a child that opens a `DiskTier` on FOLDER,
prints `ready PID`, and puts, re-puts, reads and removes records in a loop until it is
killed (or, as a safety net, for 20 s). When the child ends the server prints
`exited PID STATUS`. Forking saves a torch import (seconds on a loaded machine) per trial.

`make_record(key)` is a pure function of the key, so a reader can check any record the
tier offers against what the writer must have written.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
import traceback

import torch

from flare.state.disk_tier import DiskTier, StateRecord

NAMESPACE = "crash-test-package"
LAYOUT = '{"test":"disk-tier-crash"}'
NUM_KEYS = 120  # keys shared by all trials, so later trials re-put and touch old ones
KINDS = ("page", "tail", "checkpoint")


def key_for(i: int) -> bytes:
    return hashlib.blake2b(f"crash-key-{i}".encode(), digest_size=16).digest()


def make_record(key: bytes) -> StateRecord:
    """The one record the writer ever stores under `key` (about 2-10 KB)."""
    g = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    rows = 1 + key[8] % 8
    kind = KINDS[key[9] % 3]
    tokens = tuple(torch.randint(0, 50_000, (1 + key[10] % 16,), generator=g).tolist())
    tensors = {
        "k": torch.randn(rows, 16, 2, 8, generator=g).to(torch.bfloat16),
        "v": torch.randn(rows, 16, 2, 8, generator=g).to(torch.bfloat16),
        "recurrent.3": torch.randn(rows, 4, 8, generator=g),
    }
    parent = hashlib.blake2b(key, digest_size=16).digest()
    return StateRecord(kind, key, parent, tokens, int(key[11]), tensors)


def run_writer(folder: str, budget: int, seed: int) -> None:
    """Loop of puts (mostly), gets and removes over `NUM_KEYS` keys; never returns."""
    rng = random.Random(seed)
    tier = DiskTier(folder, NAMESPACE, LAYOUT, budget)
    os.write(1, f"ready {os.getpid()}\n".encode())
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        key = key_for(rng.randrange(NUM_KEYS))
        action = rng.random()
        if action < 0.75:
            tier.put(make_record(key))
        elif action < 0.95:
            tier.get(key)
        else:
            tier.remove(key)
    os._exit(3)  # never reached in the test: the parent kills it first


def serve() -> None:
    for line in sys.stdin:
        folder, budget, seed = line.split()
        sys.stdout.flush()  # nothing buffered may be copied into the child
        pid = os.fork()
        if pid == 0:
            try:
                run_writer(folder, int(budget), int(seed))
            except BaseException:
                traceback.print_exc()  # the test shows stderr when a trial fails
            os._exit(4)
        _, status = os.waitpid(pid, 0)
        print(f"exited {pid} {status}", flush=True)


if __name__ == "__main__":
    serve()
