"""The offline evidence verifier (`flare evidence verify`) on hand-built packets.

`flare.evidence.synthetic` writes one valid packet, `synthetic_defects` one packet per way
a packet can be wrong (DEFECTS: missing observations, missing group, dropped failed
request, clock domains mixed, coalesced events expanded, capacity mismatch, counters not
conserved, summary disagreeing with raw data, truncated JSON Lines, ...), each naming the
verdict and the check that must report it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from flare.cli import main as flare_main
from flare.evidence import recompute, synthetic, synthetic_defects
from flare.evidence.checks import Options
from flare.evidence.clocks import CLIENT, SERVER, ClockDomainError, Stamp, span
from flare.evidence.receipt import verifier_sources, verify
from flare.evidence.schema import OBSERVATIONS_FILE, SUMMARY_FILE, schema_errors

ALLOWED_IN_PASS = {"pass", "not_applicable"}


def tree_digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def statuses(receipt: dict) -> dict[str, str]:
    return {c["name"]: c["status"] for c in receipt["checks"]}


@pytest.fixture
def good(tmp_path: Path) -> Path:
    return synthetic_defects.build(tmp_path / "good")


# --------------------------------------------------------------------------- the valid packet


def test_valid_packet_passes(good: Path):
    receipt = verify(good)
    assert receipt["verdict"] == "PASS", receipt["failing_checks"]
    assert receipt["exit_code"] == 0
    assert set(statuses(receipt).values()) <= ALLOWED_IN_PASS
    assert schema_errors("receipt", receipt) == []
    names = [c["name"] for c in receipt["checks"]]
    for expected in ("schema", "integrity", "completeness", "clock-domains", "coalesced-events",
                     "capacity", "counter-conservation", "summary-agreement", "group-outcomes",
                     "thresholds"):
        assert expected in names


def test_metric_is_the_median_client_ttft_of_ttft_512(good: Path):
    receipt = verify(good)
    obs = [json.loads(line) for line in (good / OBSERVATIONS_FILE).read_text().splitlines()]
    ttfts = []
    for o in obs:
        if o["group"] != "ttft-512":
            continue
        first = next(e for e in o["client"]["events"] if (e["tokens"] or 0) >= 1)
        ttfts.append(first["t_ns"] - o["client"]["send_ns"])
    ttfts.sort()
    expected = (ttfts[2] + ttfts[3]) / 2  # six samples
    m = receipt["metric"]
    assert m["value"] == expected
    assert (m["unit"], m["clock"], m["group"], m["statistic"]) == ("ns", CLIENT, "ttft-512",
                                                                  "median")
    assert m["n_samples"] == 6
    assert m["comparison_scope"]["capacity_label"].startswith("max_seq_len=2048")


def test_metric_comes_from_observations_not_from_the_summary(tmp_path: Path):
    folder = synthetic_defects.build(tmp_path / "p", "summary-disagrees")
    receipt = verify(folder)
    summary = json.loads((folder / SUMMARY_FILE).read_text())
    claimed = summary["groups"]["ttft-512"]["ttft_client_ns"]["median"]
    assert receipt["metric"]["value"] == claimed + 5_000_000
    assert receipt["verdict"] == "FAIL"
    check = next(c for c in receipt["checks"] if c["name"] == "summary-agreement")
    assert any("ttft_client_ns.median" in f for f in check["findings"])


# --------------------------------------------------------------------------- resealed edits


def _check(receipt: dict, name: str) -> dict:
    return next(c for c in receipt["checks"] if c["name"] == name)


def test_resealed_1ns_move_of_one_event_fails_on_the_summary_binding(tmp_path: Path):
    # issue 7: one event's receive time moved by 1 ns, packet.json resealed, the harness's
    # summary kept. The move is chosen so that no figure of the summary changes.
    folder = synthetic_defects.build(tmp_path / "p", "resealed-1ns-move")
    original = synthetic_defects.build(tmp_path / "original")
    obs = [json.loads(line) for line in (folder / OBSERVATIONS_FILE).read_text().splitlines()]
    summary = json.loads((folder / SUMMARY_FILE).read_text())
    assert recompute.summarize(obs)["groups"] == summary["groups"]  # no figure changed
    assert (folder / OBSERVATIONS_FILE).read_bytes() != (original / OBSERVATIONS_FILE).read_bytes()
    receipt = verify(folder)
    assert receipt["verdict"] == "FAIL" and receipt["failing_checks"] == ["summary-agreement"]
    assert statuses(receipt)["integrity"] == "pass"  # the reseal itself is consistent
    check = _check(receipt, "summary-agreement")
    assert check["findings"][0].startswith("observations: the summary was computed from")
    assert check["evidence"]["observations_sha256"] != check["evidence"][
        "summary_observations_sha256"]


def test_summary_figures_are_compared_exactly(tmp_path: Path):
    # the binding recomputed too: a median 0.5 ns off is a disagreement, not a rounding
    folder = synthetic_defects.build(tmp_path / "p", "rebound-half-ns-median")
    receipt = verify(folder)
    assert receipt["verdict"] == "FAIL"
    findings = _check(receipt, "summary-agreement")["findings"]
    assert len(findings) == 1 and ".median: summary says" in findings[0]


def test_a_consistent_rewrite_is_invisible_offline_but_changes_the_receipt(tmp_path: Path):
    # The limit, stated in docs/evidence.md: whoever rewrites the observations, the summary
    # (figures and binding) and packet.json consistently makes a packet that verifies PASS.
    # Only an identity fixed before the edit shows it: a receipt's file sha256s.
    original = synthetic_defects.build(tmp_path / "original")
    before = verify(original)
    packet, obs = synthetic.parts()
    first = next(e for e in obs[0]["client"]["events"] if recompute.carries_tokens(e))
    first["t_ns"] -= 1_000_000  # a 1 ms better TTFT, everything recomputed
    synthetic.write(tmp_path / "rewritten", packet, obs)
    after = verify(tmp_path / "rewritten")
    assert after["verdict"] == "PASS"
    files_before = before["identities"]["packet"]["evidence_files"]
    files_after = after["identities"]["packet"]["evidence_files"]
    assert files_before[OBSERVATIONS_FILE] != files_after[OBSERVATIONS_FILE]
    assert files_before[SUMMARY_FILE] != files_after[SUMMARY_FILE]


def test_a_summary_that_binds_no_observations_is_inconclusive(tmp_path: Path):
    # summary schema version 1 (before the binding) cannot be tied to the observations
    packet, obs = synthetic.parts()
    summary = recompute.summarize(obs)
    del summary["observations"]
    summary["schema_version"] = 1
    synthetic.write(tmp_path / "p", packet, obs, summary)
    receipt = verify(tmp_path / "p")
    assert receipt["verdict"] == "INCONCLUSIVE"
    assert statuses(receipt)["schema"] == "inconclusive"
    assert statuses(receipt)["summary-agreement"] == "not_run"
    assert any("version 1 unsupported" in f for f in _check(receipt, "schema")["findings"])


def test_summary_binds_the_bytes_the_writer_puts_in_observations_jsonl(good: Path):
    summary = json.loads((good / SUMMARY_FILE).read_text())
    data = (good / OBSERVATIONS_FILE).read_bytes()
    assert summary["observations"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert summary["observations"]["count"] == data.count(b"\n")


# --------------------------------------------------------------------------- negative packets


@pytest.mark.parametrize("defect", sorted(synthetic_defects.DEFECTS))
def test_each_defect_gives_its_verdict_and_names_its_check(tmp_path: Path, defect: str):
    verdict, check, _, what = synthetic_defects.DEFECTS[defect]
    receipt = verify(synthetic_defects.build(tmp_path / defect, defect))
    assert receipt["verdict"] == verdict, (what, receipt["failing_checks"])
    assert receipt["exit_code"] == {"PASS": 0, "FAIL": 1, "INCONCLUSIVE": 2}[verdict]
    st = statuses(receipt)
    assert st[check] == ("fail" if verdict == "FAIL" else "inconclusive"), (what, st)
    found = next(c for c in receipt["checks"] if c["name"] == check)
    assert found["findings"], f"{check} must say what it found"
    assert schema_errors("receipt", receipt) == []


def test_missing_evidence_is_never_filled_with_zeros(tmp_path: Path):
    # a group whose requests all failed: no TTFT sample; the metric is null, not 0
    packet, obs = synthetic.parts()
    for o in obs:
        if o["group"] == "ttft-512":
            o["status"] = "failed"
            o["error"] = {"http_status": 503, "type": "unavailable", "message": "busy"}
            o["client"]["events"] = []
            o["usage"] = o["server"] = o["reuse"] = None
            o["server_unavailable"] = "failed"
    synthetic.write(tmp_path / "p", packet, obs)
    summary = json.loads((tmp_path / "p" / SUMMARY_FILE).read_text())
    block = summary["groups"]["ttft-512"]["ttft_client_ns"]
    assert block["n"] == 0 and block["median"] is None and block["sum"] is None
    receipt = verify(tmp_path / "p")
    assert receipt["metric"]["value"] is None
    assert receipt["verdict"] == "INCONCLUSIVE"
    assert statuses(receipt)["completeness"] == "inconclusive"


def test_thresholds(good: Path):
    value_ms = verify(good)["metric"]["value"] / 1e6
    ok = verify(good, Options(max_ms=value_ms + 1))
    assert ok["verdict"] == "PASS" and statuses(ok)["thresholds"] == "pass"
    missed = verify(good, Options(max_ms=value_ms - 1))
    assert missed["verdict"] == "FAIL" and statuses(missed)["thresholds"] == "fail"


def test_an_inconclusive_packet_stays_inconclusive_with_a_threshold_met(tmp_path: Path):
    folder = synthetic_defects.build(tmp_path / "p", "dropped-failed-request")
    receipt = verify(folder, Options(max_ms=1e9))
    assert receipt["verdict"] == "INCONCLUSIVE"


def test_other_metrics_and_groups(good: Path):
    r = verify(good, Options(metric="ttft-server-median"))
    assert r["metric"]["clock"] == SERVER and r["verdict"] == "PASS"
    r = verify(good, Options(group="miss", min_samples=1))
    assert r["metric"]["group"] == "miss"
    assert r["verdict"] == "FAIL"  # one request of `miss` failed: group-outcomes
    assert statuses(r)["group-outcomes"] == "fail"
    r = verify(good, Options(min_samples=7))  # ttft-512 has 6
    assert r["verdict"] == "INCONCLUSIVE"


# --------------------------------------------------------------------------- read only


def test_verifier_leaves_every_file_unchanged(tmp_path: Path):
    for name in (None, "truncated-jsonl", "summary-disagrees", "capacity-mismatch"):
        folder = synthetic_defects.build(tmp_path / str(name), name)
        before = tree_digest(folder)
        verify(folder)
        out = tmp_path / f"receipt-{name}.json"
        flare_main(["evidence", "verify", str(folder), "--out", str(out)])
        assert tree_digest(folder) == before, name
        assert out.is_file()


# --------------------------------------------------------------------------- receipt


def test_receipt_binds_packet_package_corpus_and_verifier(good: Path):
    receipt = verify(good)
    ids = receipt["identities"]
    files = ids["packet"]["evidence_files"]
    for name, digest in files.items():
        assert digest == hashlib.sha256((good / name).read_bytes()).hexdigest()
    assert ids["package_id"] == synthetic.PACKAGE_ID
    assert ids["corpus"]["sha256"] == "c" * 64
    v = ids["verifier"]
    assert v["sources"] == verifier_sources()
    assert "checks/counters.py" in v["sources"] and "schemas/packet.v1.schema.json" in v["sources"]
    assert len(v["sources_sha256"]) == 64


def test_identities_against_package_and_corpus_files(good: Path, tmp_path: Path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "manifest.json").write_text(json.dumps({"package_id": "d" * 64}))
    corpus = tmp_path / "corpus.json"
    corpus.write_text("{}")
    r = verify(good, Options(package=pkg, corpus=corpus))
    assert r["verdict"] == "FAIL" and statuses(r)["identities"] == "fail"


# --------------------------------------------------------------------------- CLI


def test_cli_exit_codes(tmp_path: Path, capsys):
    good = synthetic_defects.build(tmp_path / "good")
    assert flare_main(["evidence", "verify", str(good), "--out", str(tmp_path / "r.json")]) == 0
    receipt = json.loads((tmp_path / "r.json").read_text())
    assert receipt["verdict"] == "PASS"
    fail = synthetic_defects.build(tmp_path / "fail", "capacity-mismatch")
    assert flare_main(["evidence", "verify", str(fail)]) == 1
    assert json.loads(capsys.readouterr().out)["verdict"] == "FAIL"  # receipt on stdout
    inc = synthetic_defects.build(tmp_path / "inc", "truncated-jsonl")
    assert flare_main(["evidence", "verify", str(inc), "--out", str(tmp_path / "i.json")]) == 2
    # usage errors: 3, never 2 (which means INCONCLUSIVE)
    assert flare_main(["evidence", "verify", str(tmp_path / "nothing")]) == 3
    assert flare_main(["evidence", "verify", str(good), "--out", str(good / "r.json")]) == 3
    assert not (good / "r.json").exists()
    with pytest.raises(SystemExit) as e:
        flare_main(["evidence", "verify", str(good), "--no-such-flag"])
    assert e.value.code == 3
    with pytest.raises(SystemExit) as e:
        flare_main(["evidence", "verify", str(good), "--metric", "nope"])
    assert e.value.code == 3


def test_help_documents_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        flare_main(["evidence", "verify", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for line in ("0  PASS", "1  FAIL", "2  INCONCLUSIVE", "3  usage error"):
        assert line in text


# --------------------------------------------------------------------------- boundaries


def test_evidence_imports_nothing_from_server_engine_or_torch():
    code = ("import sys, flare.evidence.receipt, flare.evidence.cli, flare.evidence.synthetic_defects\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith("
            "('flare.server', 'flare.runtime', 'flare.models', 'flare.state', "
            "'flare.prepare', 'flare.loading', 'flare.qualify'))]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_duration_across_clock_domains():
    assert span(Stamp(CLIENT, 5), Stamp(CLIENT, 12)) == 7
    with pytest.raises(ClockDomainError):
        span(Stamp(CLIENT, 5), Stamp(SERVER, 12))
    with pytest.raises(ClockDomainError):
        Stamp("wall_clock", 1)


def test_statistics_definitions():
    assert recompute.median([3, 1, 2]) == 2
    assert recompute.median([1, 2, 3, 4]) == 2.5
    assert recompute.p90(list(range(1, 11))) == 9  # ceil(0.9 * 10) = 9th smallest
    assert recompute.p90([7]) == 7
    assert recompute.stats([]) == {"n": 0, "median": None, "p90": None, "min": None,
                                   "max": None, "sum": None}


def test_coalesced_events_give_no_itl_sample():
    obs = {"request_id": "r", "client": {"clock": CLIENT, "send_ns": 0, "events": [
        {"t_ns": 10, "type": "content", "tokens": 1, "chars": 1},
        {"t_ns": 20, "type": "content", "tokens": 3, "chars": 9},  # coalesced: no sample
        {"t_ns": 35, "type": "content", "tokens": 1, "chars": 2},
    ]}}
    assert recompute.ttft_client_ns(obs) == 10
    assert recompute.itl_client_ns(obs) == [15]


def test_memory_report_total_may_count_the_host_tier(tmp_path: Path):
    # on CPU the host tier of endpoint states lives in the device's memory: the report's
    # total counts it; any other total is still a capacity failure
    for extra, verdict in ((0, "PASS"), (1, "FAIL")):
        packet, obs = synthetic.parts()
        mem = packet["capacity"]["memory_report"]
        mem["host_tier_bytes"] = 1 << 30
        mem["total_bytes"] += (1 << 30) + extra
        synthetic.write(tmp_path / f"p{extra}", packet, obs)
        receipt = verify(tmp_path / f"p{extra}")
        assert receipt["verdict"] == verdict, receipt["failing_checks"]
