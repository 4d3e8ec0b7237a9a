"""Whether the packet is whole and well formed: its schema, the seal over its files,
and that every group it names has its observations.

See docs/evidence.md for each check's findings and status.
"""

from __future__ import annotations

from collections import Counter

from flare.evidence import recompute
from flare.evidence.clocks import ClockDomainError
from flare.evidence.schema import (
    PACKET_FILE,
    SCHEMA_VERSION,
    canonical_json,
    seal_digest,
    sha256_bytes,
)
from flare.evidence.checks.base import (INCONCLUSIVE, CheckResult, Options, Packet, make_result, not_run)


# --------------------------------------------------------------------------- 1. schema


def check_schema(p: Packet) -> CheckResult:
    findings = list(p.schema_findings)
    findings += [f"{n}: missing (see completeness)" for n in p.missing]
    return make_result("schema", findings, INCONCLUSIVE,
                       "every evidence file parses and validates against schema version 1",
                       "evidence files are missing, unreadable or do not match the schema",
                       evidence={"schema_version": SCHEMA_VERSION})


# --------------------------------------------------------------------------- 2. integrity


def check_integrity(p: Packet) -> CheckResult:
    if p.packet is None:
        return not_run("integrity", PACKET_FILE)
    findings = []
    raw = p.raw[PACKET_FILE] or b""
    if raw != canonical_json(p.packet).encode("utf-8"):
        findings.append(f"{PACKET_FILE}: bytes differ from its canonical form (edited after "
                        f"it was written?)")
    digest = seal_digest(p.packet)
    if digest != p.packet["seal"]["digest"]:
        findings.append(f"{PACKET_FILE}: seal digest {p.packet['seal']['digest']} but the "
                        f"content gives {digest}")
    for name, entry in p.packet["files"].items():
        data = p.raw.get(name)
        if data is None:
            findings.append(f"{name}: listed in {PACKET_FILE} but missing")
            continue
        if len(data) != entry["bytes"]:
            findings.append(f"{name}: {len(data)} bytes, {PACKET_FILE} says {entry['bytes']}")
        if sha256_bytes(data) != entry["sha256"]:
            findings.append(f"{name}: sha256 {sha256_bytes(data)}, {PACKET_FILE} says "
                            f"{entry['sha256']}")
        n_lines = data.count(b"\n")
        if "lines" in entry and n_lines != entry["lines"]:
            findings.append(f"{name}: {n_lines} lines, {PACKET_FILE} says {entry['lines']}")
    return make_result("integrity", findings, INCONCLUSIVE,
                       "file digests, sizes, line count and the seal match",
                       "the evidence files are not the ones the packet was sealed with")


# --------------------------------------------------------------------------- 3. completeness


def check_completeness(p: Packet, opts: Options) -> CheckResult:
    findings = [f"{n}: required file missing" for n in p.missing]
    if p.packet is None or p.observations is None:
        findings.append("packet.json and observations.jsonl are needed to match requests to "
                        "observations")
        return CheckResult("completeness", INCONCLUSIVE, "evidence missing", findings)
    pkt, obs = p.packet, p.observations
    ids = Counter(o["request_id"] for o in obs)
    dup = sorted(i for i, n in ids.items() if n > 1)
    if dup:
        findings.append(f"request ids observed more than once: {dup[:10]}")
    seqs = Counter(o["seq"] for o in obs)
    if any(n > 1 for n in seqs.values()):
        findings.append("observation seq numbers repeat")
    listed: dict[str, str] = {}
    for sc in pkt["scenarios"]:
        for rid in sc["request_ids"]:
            if rid in listed:
                findings.append(f"request {rid!r} listed by scenarios {listed[rid]!r} and "
                                f"{sc['name']!r}")
            listed[rid] = sc["name"]
        if sc["status"] != "ran" and not sc["reason"]:
            findings.append(f"scenario {sc['name']!r} is {sc['status']} without a reason")
    sent = pkt["requests_sent"]
    if sent != len(listed):
        findings.append(f"requests_sent is {sent} but the scenarios list {len(listed)} requests")
    unobserved = [rid for rid in listed if rid not in ids]
    if unobserved:
        findings.append(f"{len(unobserved)} request(s) sent without an observation: "
                        f"{unobserved[:10]}")
    unlisted = [rid for rid in ids if rid not in listed]
    if unlisted:
        findings.append(f"{len(unlisted)} observation(s) of requests no scenario sent: "
                        f"{unlisted[:10]}")
    for o in obs:
        sc = listed.get(o["request_id"])
        if sc is not None and sc != o["scenario"]:
            findings.append(f"observation {o['request_id']!r} says scenario {o['scenario']!r}, "
                            f"the packet lists it under {sc!r}")
    if len(obs) != sent:
        findings.append(f"{len(obs)} observations for {sent} requests sent")
    group = [o for o in obs if o["group"] == opts.group]
    duration = recompute.SELECTABLE[opts.metric][0]
    try:
        n_samples = len(recompute.samples(group, duration))
    except ClockDomainError:
        n_samples = None  # reported by clock-domains
    if not group:
        findings.append(f"group {opts.group!r} (the metric's group) has no observation")
    elif n_samples is not None and n_samples < opts.min_samples:
        findings.append(f"group {opts.group!r} gives {n_samples} sample(s) of {duration}, "
                        f"fewer than the minimum {opts.min_samples}")
    return make_result("completeness", findings, INCONCLUSIVE,
                       f"every one of {sent} requests sent has one observation; group "
                       f"{opts.group!r} has {n_samples} samples (minimum {opts.min_samples})",
                       "evidence is incomplete",
                       evidence={"requests_sent": sent, "observations": len(obs),
                             "group": opts.group, "group_observations": len(group),
                             "group_samples": n_samples, "min_samples": opts.min_samples})
