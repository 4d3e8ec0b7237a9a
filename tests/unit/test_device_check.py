"""bench/device_check.py, the GPU machine's check, run here in its CPU dry run: the same
code path (tiny model, packages, parity of the static decode step, one served chat
request, figures) on CPU, so the script cannot rot where no GPU is."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "device_check.py"


@pytest.mark.slow
def test_device_check_cpu_dry_run_passes(tmp_path, embedded_gguf):
    # a child process: the script sets FLARE_FUSED_OPS=0 for itself only
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-dry-run", "--quick",
                           "--work", str(tmp_path)], capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert out.count("PASS parity tiny cpu+graphs vs cpu") == 4
    assert out.count("PASS parity tiny cpu eager vs cpu") == 4
    assert "PASS serve cpu: chat answered" in out
    assert "FAIL" not in out
    # the static step ran (the CPU stand-in for graph replays), figures were printed
    line = next(x for x in out.splitlines() if x.startswith("FIGURE tiny cpu graphs steps"))
    assert "static eager 0," not in line
    assert "decode batch 8:" in out and "prefill 64 tokens:" in out


def test_device_check_refuses_cuda_without_a_device():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          timeout=300)
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal does not apply")
    assert proc.returncode == 1
    assert "FAIL torch.cuda.is_available() is False" in proc.stdout
