"""Crash safety of the disk tier, end to end: a process writing an engine's state records
is killed with SIGKILL at random moments (20 trials); each time a restarted engine on the
folder answers exactly as recompute, reuses only a page-aligned prefix it could verify,
and never sees a torn record.

The writer (tests/unit/tier_crash_writer.py) is a fork server: one torch import, one forked
child per trial, each writing the records a real engine demoted (tiny random Qwen3).
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_tiers import PAGE, cold, make_engine, run, tiny, two_turns  # noqa: F401

WRITER = Path(__file__).with_name("tier_crash_writer.py")
TRIALS = 20


def _readline(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError("crash writer did not answer")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"crash writer ended: {proc.stderr.read()}")
    return line.strip()


def _chain_order(records: list) -> list:
    """Root page first, then each child after its parent (how a restore needs them)."""
    by_parent = {r.parent: r for r in records}
    keys = {r.key for r in records}
    root = next(r for r in records if r.parent not in keys)
    out = [root]
    while out[-1].key in by_parent:
        out.append(by_parent[out[-1].key])
    return out


def test_sigkill_while_writing_then_restart_restores_equal_to_recompute(tiny, cold,
                                                                        tmp_path):
    engine = make_engine(tiny, host_tier_bytes=64 << 20)
    _, turn2 = two_turns(engine, seed=31)
    engine.offload()
    records = _chain_order(engine.tiers.host.drain())
    assert len(records) == 3
    records_file, layout_file = tmp_path / "records.pt", tmp_path / "layout.json"
    torch.save([{"kind": r.kind, "key": r.key, "parent": r.parent, "tokens": r.tokens,
                 "position": r.position, "tensors": r.tensors} for r in records], records_file)
    layout_file.write_text(json.dumps(engine.layout.describe(), sort_keys=True))
    want = run(cold, turn2)[0]

    writer = subprocess.Popen([sys.executable, str(WRITER)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    rng = random.Random(1234)
    reused = []
    try:
        for trial in range(TRIALS):
            folder = tmp_path / f"trial-{trial}"
            writer.stdin.write(f"{folder} {records_file} pkg-a {layout_file}\n")
            writer.stdin.flush()
            kind, pid = _readline(writer).split()
            assert kind == "ready"
            time.sleep(rng.uniform(0.005, 0.12))
            os.kill(int(pid), signal.SIGKILL)
            assert _readline(writer).startswith("exited")

            restarted = make_engine(tiny, host_tier_bytes=0, state_dir=folder)
            try:
                got, last = run(restarted, turn2, f"trial-{trial}")
                stats = restarted.stats()
            finally:
                restarted.stop()
            assert got == want, f"trial {trial}: restored output differs from recompute"
            assert last.num_cached_tokens % PAGE == 0
            # the restarted tier deleted any half-written temporary file
            assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
            rejected = {k: v for k, v in stats.items()
                        if k.startswith("disk_tier_rejected") and v}
            assert not rejected, f"trial {trial}: a torn record was offered: {rejected}"
            reused.append(last.num_cached_tokens)
    finally:
        writer.stdin.close()
        writer.kill()
        writer.wait(10)
    print("cached tokens after each crash:", reused)
    assert max(reused) > 0, f"no trial left a restorable state: {reused}"
