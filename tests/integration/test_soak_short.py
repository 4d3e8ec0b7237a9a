"""The soak of bench/soak.py, short and bounded, against a real `flare serve` process
(issue 10): mixed streamed and non-streamed chats, client disconnects, forks, completions
and bad requests for at most 20 s / 40 requests. The script's own checks must pass: no
5xx or in-stream error, every bad request a 4xx, no page held by a request afterwards,
nothing running or waiting, RSS growth after the warm-up under the bound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from server_process import ServerProcess

pytestmark = pytest.mark.slow

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def test_short_soak_passes_its_checks(smollm2_package, tmp_path):
    srv = ServerProcess(smollm2_package, tmp_path / "serve.log")
    try:
        out = tmp_path / "soak.json"
        run = subprocess.run(
            [sys.executable, str(SOAK), "--url", srv.url, "--pid", str(srv.proc.pid),
             "--minutes", "0.33", "--max-requests", "40", "--concurrency", "3",
             "--warmup", "5", "--rss-bound-mb", "256", "--seed", "7", "--json", str(out)],
            capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:] + srv.log()
        figures = json.loads(out.read_text())
        print(run.stdout)
        assert figures["failures"] == []
    finally:
        srv.stop()
