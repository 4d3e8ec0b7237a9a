"""End to end: `flare qualify --package PKG --quick` starts `flare serve PKG` in a subprocess,
runs every scenario over HTTP/SSE against the embedded model (host-restore offloads to the
host tier; restart-restore offloads to disk and restarts the server once on the same state
folder), writes a packet; then `flare evidence verify` checks it offline, and
`flare qualify report` renders it."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from flare.cli import main as flare_main
from flare.evidence.schema import OBSERVATIONS_FILE, PACKET_FILE, SUMMARY_FILE, schema_errors
from flare.qualify.runner import DEFAULT_CORPUS

pytestmark = pytest.mark.slow

HARNESS_CHECKS = ("schema", "integrity", "completeness", "clock-domains", "coalesced-events",
                  "capacity", "summary-agreement", "identities")


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def test_quick_qualification_verifies(smollm2_package: Path, tmp_path: Path, capsys):
    out = tmp_path / "packet"
    started = time.monotonic()
    assert flare_main(["qualify", "--package", str(smollm2_package), "--out", str(out),
                       "--quick"]) == 0
    took = time.monotonic() - started
    packet = json.loads((out / PACKET_FILE).read_text())
    assert schema_errors("packet", packet) == []
    obs = [json.loads(line) for line in (out / OBSERVATIONS_FILE).read_text().splitlines()]
    assert len(obs) == packet["requests_sent"] > 0
    assert all(schema_errors("observation", o) == [] for o in obs)
    assert {o["group"] for o in obs} >= {"ttft-512", "miss", "device-hit", "cancel", "branch",
                                         "agent-session", "agent-session-cold",
                                         "host-restore.setup", "host-restore",
                                         "restart-restore.setup", "restart-restore"}
    assert any(o["status"] == "cancelled" for o in obs)
    ttft = [o for o in obs if o["group"] == "ttft-512"]
    assert all(o["usage"]["prompt_tokens"] == 512 for o in ttft if o["usage"])
    status = {s["name"]: s["status"] for s in packet["scenarios"]}
    assert status["host-restore"] == status["restart-restore"] == "ran", packet["scenarios"]
    # the measured restore requests: completed, with the server's reuse record and usage,
    # client and server clocks apart, and the snapshots around them
    labels = [s["label"] for s in packet["server_state"]]
    assert "restarted:restart-restore" in labels
    for o in obs:
        if o["group"] in ("host-restore", "restart-restore"):
            assert o["status"] == "ok" and o["reuse"] is not None and o["usage"] is not None
            assert o["client"]["clock"] == "client_monotonic_ns"
            assert o["server"]["clock"] == "server_monotonic_ns"
            assert {f"before:{o['request_id']}", f"after:{o['request_id']}"} <= set(labels)
    log = (out / "server.log").read_text(errors="replace")
    assert "flare qualify: server restarted" in log
    assert packet["provenance"]["package"]["package_id"] == json.loads(
        (smollm2_package / "manifest.json").read_text())["package_id"]
    assert packet["capacity"]["claimed"]["max_seq_len"] == 2048
    assert (out / "server.log").is_file()

    before = _digests(out)
    receipt_path = tmp_path / "receipt.json"
    rc = flare_main(["evidence", "verify", str(out), "--out", str(receipt_path),
                     "--package", str(smollm2_package), "--corpus", str(DEFAULT_CORPUS)])
    assert _digests(out) == before  # the verifier only reads
    receipt = json.loads(receipt_path.read_text())
    assert rc == receipt["exit_code"]
    st = {c["name"]: c for c in receipt["checks"]}
    # what the harness owns must hold whatever the server does
    for name in HARNESS_CHECKS:
        assert st[name]["status"] == "pass", (name, st[name]["findings"])
    # the verdict is not invented: PASS exactly when every check passed
    all_passed = all(c["status"] in ("pass", "not_applicable") for c in receipt["checks"])
    assert (receipt["verdict"] == "PASS") == all_passed
    assert receipt["verdict"] == "PASS", [(n, c["findings"]) for n, c in st.items()
                                         if c["status"] not in ("pass", "not_applicable")]
    metric = receipt["metric"]
    assert metric["n_samples"] == 5 and metric["value"] > 0

    assert flare_main(["qualify", "report", str(out)]) == 0
    table = capsys.readouterr().out
    assert "ttft-512" in table and "restart-restore/" in table
    for png in ("ttft_per_group.png", "agent_ttft_per_turn.png", "agent_cached_per_turn.png"):
        assert (out / "report" / png).stat().st_size > 1000
    with capsys.disabled():
        print(f"\nquick qualification took {took:.1f} s\n{table}")
    assert (out / SUMMARY_FILE).is_file()
