"""What every check of `flare evidence verify` shares: statuses, `CheckResult`, the
caller's `Options`, and the loaded `Packet`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flare.evidence import recompute
from flare.evidence.schema import (
    OBSERVATIONS_FILE,
    PACKET_FILE,
    PACKET_SCHEMA,
    SCHEMA_VERSION,
    SUMMARY_FILE,
    SUMMARY_SCHEMA,
    SUMMARY_SCHEMA_VERSION,
    schema_errors,
)

PASS, FAIL, INCONCLUSIVE, NOT_RUN, NOT_APPLICABLE = (
    "pass", "fail", "inconclusive", "not_run", "not_applicable")
MAX_FINDINGS = 20


@dataclass
class CheckResult:
    name: str
    status: str
    message: str
    findings: list[str] = field(default_factory=list)
    not_evaluated: list[str] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "message": self.message,
                "findings": self.findings[:MAX_FINDINGS],
                "findings_total": len(self.findings),
                "not_evaluated": self.not_evaluated, "evidence": self.evidence}


@dataclass
class Options:
    """Verifier settings (CLI flags)."""

    metric: str = recompute.DEFAULT_METRIC
    group: str = recompute.DEFAULT_GROUP
    min_samples: int = 5
    max_ms: float | None = None
    package: Path | None = None
    corpus: Path | None = None


@dataclass
class Packet:
    """A packet as read from disk: raw bytes of each evidence file (None when missing),
    and the parsed content of those that parsed and validated."""

    folder: Path
    raw: dict[str, bytes | None]
    packet: dict[str, Any] | None = None
    observations: list[dict[str, Any]] | None = None
    summary: dict[str, Any] | None = None
    schema_findings: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)


def read_optional(path: Path) -> bytes | None:
    """The file's bytes, or None when it is missing or unreadable."""
    try:
        with open(path, "rb") as f:  # read only: never opened for writing
            return f.read()
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return None


def load(folder: Path) -> Packet:
    """Read the evidence files of `folder` and parse and validate what is there."""
    folder = Path(folder)
    raw = {name: read_optional(folder / name) for name in (PACKET_FILE, OBSERVATIONS_FILE, SUMMARY_FILE)}
    p = Packet(folder, raw)
    p.missing = [n for n, b in raw.items() if b is None]
    findings = p.schema_findings

    def parse_json(name: str) -> Any:
        data = raw[name]
        if data is None:
            return None
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            findings.append(f"{name}: not valid UTF-8 JSON ({e})")
            return None

    pkt = parse_json(PACKET_FILE)
    if pkt is not None:
        if not isinstance(pkt, dict):
            findings.append(f"{PACKET_FILE}: expected a JSON object, found {type(pkt).__name__}")
        elif pkt.get("schema") != PACKET_SCHEMA or pkt.get("schema_version") != SCHEMA_VERSION:
            findings.append(f"{PACKET_FILE}: schema {pkt.get('schema')!r} version "
                            f"{pkt.get('schema_version')!r} unsupported; this verifier reads "
                            f"{PACKET_SCHEMA!r} version {SCHEMA_VERSION}")
        else:
            errs = schema_errors("packet", pkt)
            findings.extend(f"{PACKET_FILE}: {e}" for e in errs)
            if not errs:
                p.packet = pkt

    data = raw[OBSERVATIONS_FILE]
    if data is not None:
        obs_ok = True
        observations = []
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        elif lines:
            findings.append(f"{OBSERVATIONS_FILE}: last line has no newline (truncated file?)")
            obs_ok = False
        for i, line in enumerate(lines, 1):
            try:
                obj = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                findings.append(f"{OBSERVATIONS_FILE} line {i}: not valid JSON ({e})")
                obs_ok = False
                continue
            if not isinstance(obj, dict):
                findings.append(f"{OBSERVATIONS_FILE} line {i}: expected a JSON object")
                obs_ok = False
                continue
            errs = schema_errors("observation", obj, limit=3)
            if errs:
                findings.extend(f"{OBSERVATIONS_FILE} line {i}: {e}" for e in errs)
                obs_ok = False
            observations.append(obj)
        if obs_ok:
            p.observations = observations

    summ = parse_json(SUMMARY_FILE)
    if isinstance(summ, dict) and (summ.get("schema") != SUMMARY_SCHEMA
                                   or summ.get("schema_version") != SUMMARY_SCHEMA_VERSION):
        # version 1 summaries did not bind the observations they describe
        findings.append(f"{SUMMARY_FILE}: schema {summ.get('schema')!r} version "
                        f"{summ.get('schema_version')!r} unsupported; this verifier reads "
                        f"{SUMMARY_SCHEMA!r} version {SUMMARY_SCHEMA_VERSION} (it binds the "
                        f"sha256 of the observations it summarizes)")
    elif summ is not None:
        errs = schema_errors("summary", summ)
        findings.extend(f"{SUMMARY_FILE}: {e}" for e in errs)
        if not errs:
            p.summary = summ
    return p


def make_result(name: str, findings: list[str], bad: str, ok_msg: str, bad_msg: str,
                not_evaluated: list[str] | None = None,
                evidence: dict | None = None) -> CheckResult:
    """A check's result: status `bad` with `bad_msg` when there are findings, else pass."""
    status = bad if findings else PASS
    return CheckResult(name, status, bad_msg if findings else ok_msg, findings,
                       not_evaluated or [], evidence or {})


def not_run(name: str, needs: str) -> CheckResult:
    """A check that could not run because `needs` failed the schema check."""
    return CheckResult(name, NOT_RUN, f"not run: {needs} did not survive the schema check")
