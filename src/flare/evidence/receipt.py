"""`verify`: run every check on a packet and build the receipt.

Verdict rules (docs/evidence.md):
- INCONCLUSIVE when any check is `inconclusive` or `not_run`: evidence is missing or
  inconsistent, so nothing can be concluded (a FAIL found elsewhere is still listed);
- else FAIL when any check is `fail`;
- else PASS: every check passed (or is `not_applicable`) and every threshold given is met.
The verdict never reads `summary.json` for the metric: the metric is recomputed from the
observations.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flare.evidence import VERIFIER_NAME, VERIFIER_VERSION, checks, recompute
from flare.evidence.checks import FAIL, INCONCLUSIVE, NOT_RUN, Options
from flare.evidence.clocks import ClockDomainError
from flare.evidence.schema import EVIDENCE_FILES, sha256_bytes

PASS_V, FAIL_V, INCONCLUSIVE_V = "PASS", "FAIL", "INCONCLUSIVE"
EXIT_CODES = {PASS_V: 0, FAIL_V: 1, INCONCLUSIVE_V: 2}  # usage errors: 3 (evidence.cli)
RECEIPT_SCHEMA = "flare-evidence-receipt"


def verifier_sources() -> dict[str, str]:
    """sha256 of each source file of the verifier (this package's .py and schema files),
    by path relative to the package."""
    root = Path(__file__).parent
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".json") and "__pycache__" not in path.parts:
            out[path.relative_to(root).as_posix()] = sha256_bytes(path.read_bytes())
    return out


def _digest_of(entries: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name in sorted(entries):
        h.update(f"{name}\0{entries[name]}\n".encode())
    return h.hexdigest()


def packet_identity(p: checks.Packet) -> dict[str, Any]:
    """sha256 of each evidence file as read, and of every other file in the folder."""
    files = {name: (sha256_bytes(data) if data is not None else None)
             for name, data in p.raw.items()}
    others = {}
    folder = p.folder
    if folder.is_dir():
        for path in sorted(folder.rglob("*")):
            rel = path.relative_to(folder).as_posix()
            if path.is_file() and rel not in EVIDENCE_FILES:
                with open(path, "rb") as f:
                    others[rel] = hashlib.sha256(f.read()).hexdigest()
    return {"path": str(folder.resolve()), "packet_id": (p.packet or {}).get("packet_id"),
            "evidence_files": files, "other_files": others}


def verdict_of(results: list[checks.CheckResult]) -> str:
    statuses = {r.status for r in results}
    if INCONCLUSIVE in statuses or NOT_RUN in statuses:
        return INCONCLUSIVE_V
    if FAIL in statuses:
        return FAIL_V
    return PASS_V


def verify(folder: Path, opts: Options | None = None) -> dict[str, Any]:
    """Check the packet in `folder` (only read) and return the receipt (a dict)."""
    opts = opts or Options()
    if opts.metric not in recompute.SELECTABLE:
        raise ValueError(f"unknown metric {opts.metric!r}; known: {sorted(recompute.SELECTABLE)}")
    p = checks.load(Path(folder))
    results = [
        checks.check_schema(p),
        checks.check_integrity(p),
        checks.check_completeness(p, opts),
        checks.check_clock_domains(p),
        checks.check_coalesced(p),
        checks.check_capacity(p),
        checks.check_counters(p),
        checks.check_summary(p),
        checks.check_group_outcomes(p, opts),
    ]
    metric = None
    if p.observations is not None:
        try:
            metric = recompute.select_metric(opts.metric, p.observations, opts.group)
        except ClockDomainError:
            metric = None  # clock-domains says why
    results.append(checks.check_thresholds(metric, opts))
    results.append(checks.check_identities(p, opts))
    verdict = verdict_of(results)
    pkt = p.packet or {}
    prov = pkt.get("provenance") or {}
    package = prov.get("package") or {}
    sources = verifier_sources()
    if metric is not None:
        metric = {**metric,
                  "definition": recompute.DEFINITIONS[metric["duration"]],
                  "comparison_scope": {
                      "group": opts.group,
                      "capacity_label": (pkt.get("capacity") or {}).get("label"),
                      "package_id": package.get("package_id"),
                      "note": "compare only with receipts of the same metric, group, "
                              "capacity label and package_id"}}
    return {
        "schema": RECEIPT_SCHEMA,
        "schema_version": 1,
        "verdict": verdict,
        "exit_code": EXIT_CODES[verdict],
        "failing_checks": [r.name for r in results if r.status in (FAIL, INCONCLUSIVE, NOT_RUN)],
        "checks": [r.to_dict() for r in results],
        "metric": metric,
        "thresholds": {"max_ms": opts.max_ms},
        "identities": {
            "packet": packet_identity(p),
            "package_id": package.get("package_id"),
            "manifest_sha256": package.get("manifest_sha256"),
            "corpus": prov.get("corpus"),
            "verifier": {"name": VERIFIER_NAME, "version": VERIFIER_VERSION,
                         "sources": sources, "sources_sha256": _digest_of(sources)},
        },
        "settings": {"metric": opts.metric, "group": opts.group,
                     "min_samples": opts.min_samples,
                     "package": str(opts.package) if opts.package else None,
                     "corpus": str(opts.corpus) if opts.corpus else None},
        "verified_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
