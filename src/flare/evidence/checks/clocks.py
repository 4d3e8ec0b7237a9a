"""Client and server clocks kept apart: every duration is taken within one clock domain,
and streamed events are not coalesced into one.

See docs/evidence.md for each check's findings and status.
"""

from __future__ import annotations

from collections import Counter

from flare.evidence import recompute
from flare.evidence.clocks import CLIENT, SERVER, ClockDomainError, domain_of_path
from flare.evidence.checks.base import (FAIL, INCONCLUSIVE, PASS,
                                        CheckResult, Packet, not_run, make_result)


# --------------------------------------------------------------------------- 4. clock domains


def check_clock_domains(p: Packet) -> CheckResult:
    if p.packet is None or p.observations is None:
        return not_run("clock-domains", "packet.json or observations.jsonl")
    raw_findings: list[str] = []  # inconsistent raw timestamps: inconclusive
    claim_findings: list[str] = []  # summary claims across domains: fail
    clocks = p.packet["clocks"]
    server_available = clocks["server"]["available"]
    n_server = 0
    for o in p.observations:
        rid = o["request_id"]
        c = o["client"]
        if c["clock"] != CLIENT:
            raw_findings.append(f"{rid}: client block labelled {c['clock']!r}, expected {CLIENT!r}")
        seq = [("send_ns", c["send_ns"])]
        if c["headers_ns"] is not None:
            seq.append(("headers_ns", c["headers_ns"]))
        seq += [(f"events[{i}]", e["t_ns"]) for i, e in enumerate(c["events"])]
        if c["end_ns"] is not None:
            seq.append(("end_ns", c["end_ns"]))
        for (na, a), (nb, b) in zip(seq, seq[1:]):
            if b < a:
                raw_findings.append(f"{rid}: client clock goes back from {na} to {nb} "
                                    f"({a} > {b})")
                break
        s = o["server"]
        if s is not None:
            n_server += 1
            if s["clock"] != SERVER:
                raw_findings.append(f"{rid}: server block labelled {s['clock']!r}, expected "
                                    f"{SERVER!r}")
            t = s["timings"]
            order = [k for k in ("arrival_ns", "scheduled_ns", "first_token_ns", "finished_ns")
                     if t.get(k) is not None]
            for ka, kb in zip(order, order[1:]):
                if t[kb] < t[ka]:
                    raw_findings.append(f"{rid}: server clock goes back from {ka} to {kb} "
                                        f"({t[ka]} > {t[kb]})")
                    break
            if not server_available:
                raw_findings.append(f"{rid}: server timings present but packet.json says the "
                                    f"server clock is unavailable")
        elif o["server_unavailable"] is None:
            raw_findings.append(f"{rid}: no server timings and no reason why")
    if p.summary is not None:
        for gname, g in p.summary["groups"].items():
            for mname, block in g.items():
                if not isinstance(block, dict) or "clock" not in block:
                    continue
                da, db = domain_of_path(block["from"]), domain_of_path(block["to"])
                if da != db or da != block["clock"]:
                    claim_findings.append(
                        f"summary {gname}.{mname}: a duration from {block['from']!r} ({da}) to "
                        f"{block['to']!r} ({db}) labelled {block['clock']!r}: mixes clock "
                        f"domains")
    findings = raw_findings + claim_findings
    status = INCONCLUSIVE if raw_findings else FAIL if claim_findings else PASS
    msg = {PASS: "every timestamp is labelled with its domain and monotonic in it; no "
                 "duration mixes domains",
           INCONCLUSIVE: "raw timestamps are mislabelled or go back in time: no duration "
                         "from them can be trusted",
           FAIL: "the summary claims durations across clock domains"}[status]
    not_evaluated = []
    if n_server == 0:
        not_evaluated.append("server clock: no observation carries server timings ("
                             + (clocks["server"]["reason"] or "no reason given") + ")")
    return CheckResult("clock-domains", status, msg, findings, not_evaluated,
                       {"observations_with_server_timings": n_server})


# --------------------------------------------------------------------------- 5. coalesced events


def check_coalesced(p: Packet) -> CheckResult:
    if p.observations is None:
        return not_run("coalesced-events", "observations.jsonl")
    findings = []
    coalesced = 0
    eligible: Counter[str] = Counter()
    counted = p.packet["settings"]["token_count_method"] if p.packet else None
    for o in p.observations:
        evs = recompute.token_events(o)
        for prev, cur in zip(evs, evs[1:]):
            if cur["t_ns"] == prev["t_ns"]:
                findings.append(f"{o['request_id']}: token-carrying events share receive time "
                                f"{cur['t_ns']}: a coalesced event expanded into invented "
                                f"per-token events")
                break
        coalesced += sum(1 for e in evs if (e["tokens"] or 0) > 1)
        if counted == "none" and any(e["tokens"] is not None for e in o["client"]["events"]):
            findings.append(f"{o['request_id']}: token counts present but packet.json says "
                            f"tokens were not counted")
        try:
            eligible[o["group"]] += len(recompute.itl_client_ns(o))
        except ClockDomainError:
            pass  # reported by clock-domains
    if p.summary is not None:
        for gname, g in p.summary["groups"].items():
            claimed = g["itl_client_ns"]["n"]
            if claimed > eligible.get(gname, 0):
                findings.append(f"summary {gname}.itl_client_ns has {claimed} samples but the "
                                f"observations give only {eligible.get(gname, 0)} intervals "
                                f"ending in a single-token event: per-token times were "
                                f"invented for coalesced events")
    return make_result("coalesced-events", findings, FAIL,
                       f"no invented per-token times ({coalesced} coalesced events kept as one)",
                       "per-token times were invented for coalesced events",
                       evidence={"coalesced_events": coalesced,
                             "itl_intervals_by_group": dict(eligible)})
