"""Agreement: the packet's summary equals the one recomputed from its observations, and
the package and corpus identities match the files.

See docs/evidence.md for each check's findings and status.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flare.evidence import recompute
from flare.evidence.clocks import ClockDomainError
from flare.evidence.schema import (
    PACKET_FILE,
    observations_sha256,
    sha256_bytes,
)
from flare.evidence.checks.base import (FAIL, INCONCLUSIVE, NOT_APPLICABLE, PASS,
                                        CheckResult, Options, Packet, make_result, not_run, read_optional)


# --------------------------------------------------------------------------- 8. summary


def _compare(path: str, claimed: Any, recomputed: Any, out: list[str]) -> None:
    """Append to `out` every difference between `claimed` and `recomputed`, by path.

    Numbers are compared exactly (int and float alike: a median of integer ns is an integer
    or a half-integer, exact in a float and in JSON), so no edit of a sample hides inside a
    tolerance."""
    if isinstance(recomputed, dict) and isinstance(claimed, dict):
        for k in sorted(set(claimed) | set(recomputed)):
            if k not in claimed:
                out.append(f"{path}.{k}: missing from the summary (recomputed {recomputed[k]!r})")
            elif k not in recomputed:
                out.append(f"{path}.{k}: in the summary ({claimed[k]!r}) but not recomputable")
            else:
                _compare(f"{path}.{k}", claimed[k], recomputed[k], out)
        return
    if isinstance(claimed, bool) != isinstance(recomputed, bool) or claimed != recomputed:
        out.append(f"{path}: summary says {claimed!r}, recomputed {recomputed!r}")


def check_summary(p: Packet) -> CheckResult:
    """The summary is a claim about the observations: it must name these observations (its
    `observations.sha256` equals the sha256 of the canonical form of what observations.jsonl
    parses to) and its figures must equal the recomputation from them, exactly.

    The binding catches an edit of the raw data that was resealed (packet.json's file
    digests and seal recomputed) while the harness's summary was kept, even when the edit
    leaves every figure unchanged; the exact comparison catches any edit that changes a
    figure, even when the binding was recomputed too. An edit whose author also rewrote
    every figure consistently is not detectable here (docs/evidence.md)."""
    if p.observations is None or p.summary is None:
        return not_run("summary-agreement", "observations.jsonl or summary.json")
    findings: list[str] = []
    claimed_binding = p.summary["observations"]
    digest = observations_sha256(p.observations)
    if claimed_binding["sha256"] != digest:
        findings.append(f"observations: the summary was computed from observations with "
                        f"sha256 {claimed_binding['sha256']} ({claimed_binding['count']} "
                        f"requests), observations.jsonl holds {digest} "
                        f"({len(p.observations)} requests): the raw data changed after it "
                        f"was summarized")
    elif claimed_binding["count"] != len(p.observations):
        findings.append(f"observations.count: summary says {claimed_binding['count']}, "
                        f"observations.jsonl holds {len(p.observations)}")
    try:
        recomputed = recompute.summarize(p.observations)
    except ClockDomainError as e:
        return CheckResult("summary-agreement", INCONCLUSIVE,
                           "observations cannot be summarized", [str(e)] + findings)
    _compare("groups", p.summary["groups"], recomputed["groups"], findings)
    return make_result("summary-agreement", findings, FAIL,
                       "the summary names these observations (sha256) and equals the "
                       "recomputation from them exactly",
                       "the summary disagrees with the raw observations",
                       evidence={"observations_sha256": digest,
                             "summary_observations_sha256": claimed_binding["sha256"],
                             "comparison": "exact",
                             "groups": sorted(recomputed["groups"])})


# --------------------------------------------------------------------------- 11. identities


def check_identities(p: Packet, opts: Options) -> CheckResult:
    """With --package / --corpus: the packet's package_id, manifest and corpus digests equal
    those of the files given."""
    if opts.package is None and opts.corpus is None:
        return CheckResult("identities", NOT_APPLICABLE, "no --package or --corpus given")
    if p.packet is None:
        return not_run("identities", PACKET_FILE)
    prov = p.packet["provenance"]
    findings: list[str] = []
    missing: list[str] = []
    if opts.package is not None:
        mpath = Path(opts.package) / "manifest.json"
        data = read_optional(mpath)
        if data is None:
            missing.append(f"{mpath}: cannot be read")
        elif prov["package"] is None:
            missing.append("the packet names no package")
        else:
            try:
                pid = json.loads(data).get("package_id")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
                pid = None
            if pid != prov["package"]["package_id"]:
                findings.append(f"package_id: packet {prov['package']['package_id']}, "
                                f"{mpath} {pid}")
            if sha256_bytes(data) != prov["package"]["manifest_sha256"]:
                findings.append(f"manifest sha256: packet {prov['package']['manifest_sha256']}, "
                                f"{mpath} {sha256_bytes(data)}")
    if opts.corpus is not None:
        data = read_optional(Path(opts.corpus))
        if data is None:
            missing.append(f"{opts.corpus}: cannot be read")
        elif prov["corpus"] is None:
            missing.append("the packet names no corpus")
        elif sha256_bytes(data) != prov["corpus"]["sha256"]:
            findings.append(f"corpus sha256: packet {prov['corpus']['sha256']}, "
                            f"{opts.corpus} {sha256_bytes(data)}")
    status = FAIL if findings else INCONCLUSIVE if missing else PASS
    return CheckResult("identities", status,
                       {PASS: "the package and corpus given are the ones the packet names",
                        FAIL: "the packet was not produced with the package or corpus given",
                        INCONCLUSIVE: "identity evidence is missing"}[status],
                       findings + missing)
