"""The named checks of `flare evidence verify`, each a function of the loaded packet.

Each check returns a `CheckResult`: a status, a one-line message, its findings (what is
wrong, each naming where) and what it could not evaluate (with why). Statuses:
- `pass`: everything it evaluated holds;
- `fail`: the evidence is intact and shows a violation;
- `inconclusive`: evidence it needs is missing, unreadable or inconsistent in itself;
- `not_run`: an input it needs did not survive an earlier check (counts as inconclusive);
- `not_applicable`: nothing to check (thresholds when none were given).

docs/evidence.md lists every check, its findings and their status.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flare.evidence import recompute
from flare.evidence.clocks import CLIENT, SERVER, ClockDomainError, domain_of_path
from flare.evidence.schema import (
    OBSERVATIONS_FILE,
    PACKET_FILE,
    PACKET_SCHEMA,
    SCHEMA_VERSION,
    SUMMARY_FILE,
    SUMMARY_SCHEMA,
    SUMMARY_SCHEMA_VERSION,
    canonical_json,
    observations_sha256,
    schema_errors,
    seal_digest,
    sha256_bytes,
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


def _read(path: Path) -> bytes | None:
    try:
        with open(path, "rb") as f:  # read only: never opened for writing
            return f.read()
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        return None


def load(folder: Path) -> Packet:
    """Read the evidence files of `folder` and parse and validate what is there."""
    folder = Path(folder)
    raw = {name: _read(folder / name) for name in (PACKET_FILE, OBSERVATIONS_FILE, SUMMARY_FILE)}
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


def _result(name: str, findings: list[str], bad: str, ok_msg: str, bad_msg: str,
            not_evaluated: list[str] | None = None, evidence: dict | None = None) -> CheckResult:
    status = bad if findings else PASS
    return CheckResult(name, status, bad_msg if findings else ok_msg, findings,
                       not_evaluated or [], evidence or {})


def _not_run(name: str, needs: str) -> CheckResult:
    return CheckResult(name, NOT_RUN, f"not run: {needs} did not survive the schema check")


# --------------------------------------------------------------------------- 1. schema


def check_schema(p: Packet) -> CheckResult:
    findings = list(p.schema_findings)
    findings += [f"{n}: missing (see completeness)" for n in p.missing]
    return _result("schema", findings, INCONCLUSIVE,
                   "every evidence file parses and validates against schema version 1",
                   "evidence files are missing, unreadable or do not match the schema",
                   evidence={"schema_version": SCHEMA_VERSION})


# --------------------------------------------------------------------------- 2. integrity


def check_integrity(p: Packet) -> CheckResult:
    if p.packet is None:
        return _not_run("integrity", PACKET_FILE)
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
    return _result("integrity", findings, INCONCLUSIVE,
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
    return _result("completeness", findings, INCONCLUSIVE,
                   f"every one of {sent} requests sent has one observation; group "
                   f"{opts.group!r} has {n_samples} samples (minimum {opts.min_samples})",
                   "evidence is incomplete",
                   evidence={"requests_sent": sent, "observations": len(obs),
                             "group": opts.group, "group_observations": len(group),
                             "group_samples": n_samples, "min_samples": opts.min_samples})


# --------------------------------------------------------------------------- 4. clock domains


def check_clock_domains(p: Packet) -> CheckResult:
    if p.packet is None or p.observations is None:
        return _not_run("clock-domains", "packet.json or observations.jsonl")
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
        return _not_run("coalesced-events", "observations.jsonl")
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
    return _result("coalesced-events", findings, FAIL,
                   f"no invented per-token times ({coalesced} coalesced events kept as one)",
                   "per-token times were invented for coalesced events",
                   evidence={"coalesced_events": coalesced,
                             "itl_intervals_by_group": dict(eligible)})


# --------------------------------------------------------------------------- 6. capacity

PLAN_KEYS = ("max_seq_len", "max_num_seqs", "page_size", "num_pages", "max_batch_tokens", "dtype")


def capacity_label(claimed: dict[str, Any]) -> str:
    """The label of a capacity: "k=v" for each plan key, space separated, in PLAN_KEYS order."""
    return " ".join(f"{k}={claimed[k]}" for k in PLAN_KEYS)


def check_capacity(p: Packet) -> CheckResult:
    if p.packet is None:
        return _not_run("capacity", PACKET_FILE)
    cap = p.packet["capacity"]
    claimed = cap["claimed"]
    fails: list[str] = []
    missing: list[str] = []
    not_evaluated: list[str] = []
    unknown = [k for k in PLAN_KEYS if claimed.get(k) is None]
    if unknown:
        missing.append(f"the claimed capacity leaves {unknown} unknown (run with --package)")
    if cap["label"] != capacity_label(claimed):
        fails.append(f"label {cap['label']!r} does not describe the claimed capacity "
                     f"{capacity_label(claimed)!r}")
    plan, mem, kv = cap["plan"], cap["memory_report"], cap["kv_layout"]
    if plan is None:
        missing.append("no package plan in the packet (run with --package)")
    else:
        for k in PLAN_KEYS:
            if plan.get(k) != claimed.get(k):
                fails.append(f"claimed {k}={claimed.get(k)!r} but the package plan has "
                             f"{plan.get(k)!r}")
    if mem is None:
        missing.append("no memory report in the packet (run with --package)")
    else:
        # hybrid packages also hold a pool of conv/recurrent state slots (0 for KV-only)
        parts = (mem["weights_bytes"] + mem["kv_pool_bytes"] + mem["workspace_bytes"]
                 + mem.get("state_pool_bytes", 0))
        # the host tier of endpoint states and the serving runtime's own base are in the
        # total when the device is the host (CPU); older reports have no runtime figure
        host = mem.get("host_tier_bytes", 0) + mem.get("runtime_bytes", 0)
        if mem["total_bytes"] not in (parts, parts + host):
            fails.append(f"memory report total {mem['total_bytes']} != weights + KV pool + "
                         f"state pool + workspace = {parts}"
                         + (f" (+ host tier and runtime {host} = {parts + host})"
                            if host else ""))
        if mem["total_bytes"] > mem["device_bytes"]:
            fails.append(f"memory report total {mem['total_bytes']} exceeds the device's "
                         f"{mem['device_bytes']} bytes")
        if kv is None:
            not_evaluated.append("KV pool bytes against the claimed pages: no KV layout")
        elif unknown:
            not_evaluated.append("KV pool bytes against the claimed pages: capacity unknown")
        elif not kv["kv_only"]:
            not_evaluated.append("KV pool bytes against the claimed pages: recipe keeps more "
                                 "than KV pages (formula not known to this verifier)")
        else:
            per_token = (2 * kv["num_kv_layers"] * kv["num_kv_heads"] * kv["head_dim"]
                         * kv["elem_bytes"])
            expect = claimed["num_pages"] * claimed["page_size"] * per_token
            if expect != mem["kv_pool_bytes"]:
                fails.append(f"claimed {claimed['num_pages']} pages x {claimed['page_size']} "
                             f"tokens x {per_token} B/token = {expect} B of KV, the memory "
                             f"report says {mem['kv_pool_bytes']}")
    snaps = [s for s in p.packet["server_state"] if "pages_total" in s["state"]]
    if not snaps:
        missing.append("the server reported no pages_total (GET /debug/state)")
    totals = sorted({s["state"]["pages_total"] for s in snaps})
    if len(totals) > 1:
        fails.append(f"the server reported different capacities during the run: pages_total "
                     f"{totals}; one packet must be one condition")
    for t in totals:
        if claimed["num_pages"] is not None and t != claimed["num_pages"]:
            fails.append(f"claimed num_pages={claimed['num_pages']} but the server reported "
                         f"pages_total={t}")
    sml = cap["server_max_model_len"]
    if sml is None:
        not_evaluated.append("max_seq_len against the server: /v1/models gave no max_model_len")
    elif claimed["max_seq_len"] is not None and sml != claimed["max_seq_len"]:
        fails.append(f"claimed max_seq_len={claimed['max_seq_len']} but the server reports "
                     f"max_model_len={sml}")
    findings = fails + missing
    status = FAIL if fails else INCONCLUSIVE if missing else PASS
    msg = {PASS: f"the claimed capacity ({cap['label']}) matches the package plan, its memory "
                 f"report and the server",
           FAIL: "the claimed capacity does not match the evidence",
           INCONCLUSIVE: "capacity evidence is missing"}[status]
    return CheckResult("capacity", status, msg, findings, not_evaluated,
                       {"label": cap["label"], "server_pages_total": totals})


# --------------------------------------------------------------------------- 7. counters

REUSE_KEYS = {
    "lookups": "reuse_lookups_total",
    "hits": "reuse_hits_total",
    "admitted_tokens": "reuse_admitted_tokens_total",
    "reused_tokens": "reuse_reused_tokens_total",
    "queried_tokens": "prefix_cache_queries_total",
    "NoMatch": "reuse_outcome_no_match_total",
    "CostRejected": "reuse_outcome_cost_rejected_total",
    "CapacityRejected": "reuse_outcome_capacity_rejected_total",
    "EnqueueRejected": "reuse_outcome_enqueue_rejected_total",
    "Admitted": "reuse_outcome_admitted_total",
}
HIT_OUTCOMES = ("CostRejected", "CapacityRejected", "EnqueueRejected", "Admitted")
# A snapshot labelled `restarted:<scenario>` is the first of a new server process (the
# harness restarted the server on the same state folder; its counters start again at 0).
RESTARTED = "restarted:"
RESTART_COUNTERS = ("requests_finished_total", "requests_aborted_total")


def server_lifetimes(snaps: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The snapshots split into server lifetimes: each `restarted:` snapshot begins one."""
    out: list[list[dict[str, Any]]] = [[]]
    for s in snaps:
        if s["label"].startswith(RESTARTED) and out[-1]:
            out.append([])
        out[-1].append(s)
    return out


def _reached_engine(o: dict[str, Any]) -> bool | None:
    """Whether a request reached the engine: ok and cancelled (cancelled after the server
    answered) did; a failure with an HTTP error status did not; None when unknown."""
    if o["status"] == "ok":
        return True
    http = (o["error"] or {}).get("http_status")
    if o["status"] == "cancelled":
        return True if o["client"]["headers_ns"] is not None else None
    if http is None:
        return None
    return http == 200  # an in-band error in a stream the server had accepted


def check_counters(p: Packet) -> CheckResult:
    if p.packet is None or p.observations is None:
        return _not_run("counter-conservation", "packet.json or observations.jsonl")
    findings: list[str] = []
    not_evaluated: list[str] = []
    missing: list[str] = []
    evaluated: list[str] = []
    obs = p.observations
    # per request
    n_reuse = 0
    for o in obs:
        rid, u, r = o["request_id"], o["usage"], o["reuse"]
        if u is not None and u["cached_tokens"] is not None:
            if u["cached_tokens"] > u["prompt_tokens"]:
                findings.append(f"{rid}: cached_tokens {u['cached_tokens']} > prompt_tokens "
                                f"{u['prompt_tokens']}")
        if r is None:
            continue
        n_reuse += 1
        if r["reused_tokens"] > r["matched_tokens"]:
            findings.append(f"{rid}: reused_tokens {r['reused_tokens']} > matched_tokens "
                            f"{r['matched_tokens']}")
        if r["outcome"] != "Admitted" and r["reused_tokens"] != 0:
            findings.append(f"{rid}: outcome {r['outcome']} but reused_tokens "
                            f"{r['reused_tokens']}")
        if r["outcome"] == "NoMatch" and r["matched_tokens"] != 0:
            findings.append(f"{rid}: outcome NoMatch but matched_tokens {r['matched_tokens']}")
        if u is not None:
            if r["reused_tokens"] > u["prompt_tokens"]:
                findings.append(f"{rid}: reused_tokens {r['reused_tokens']} exceed the prompt's "
                                f"{u['prompt_tokens']} tokens")
            if u["cached_tokens"] is not None and u["cached_tokens"] != r["reused_tokens"]:
                findings.append(f"{rid}: usage cached_tokens {u['cached_tokens']} != reuse "
                                f"reused_tokens {r['reused_tokens']}")
    if n_reuse:
        evaluated.append(f"per-request reuse records ({n_reuse})")
    else:
        not_evaluated.append("per-request reuse: the server reported no reuse record")
    # server snapshots
    snaps = p.packet["server_state"]
    if not snaps:
        missing.append("no server state snapshot (GET /debug/state) in the packet")
    for s in snaps:
        st, lab = s["state"], s["label"]
        if {"pages_total", "pages_used", "pages_free"} <= st.keys():
            if st["pages_used"] + st["pages_free"] != st["pages_total"]:
                findings.append(f"snapshot {lab}: pages_used {st['pages_used']} + pages_free "
                                f"{st['pages_free']} != pages_total {st['pages_total']}")
        if s["idle"] and (st.get("num_running", 0) or st.get("num_waiting", 0)):
            findings.append(f"snapshot {lab}: marked idle with {st.get('num_running')} running "
                            f"and {st.get('num_waiting')} waiting")
        if all(k in st for k in REUSE_KEYS.values()):
            g = {k: st[v] for k, v in REUSE_KEYS.items()}
            if g["lookups"] != g["NoMatch"] + g["hits"]:
                findings.append(f"snapshot {lab}: lookups {g['lookups']} != NoMatch "
                                f"{g['NoMatch']} + hits {g['hits']}")
            hit_sum = sum(g[k] for k in HIT_OUTCOMES)
            if g["hits"] != hit_sum:
                findings.append(f"snapshot {lab}: hits {g['hits']} != CostRejected + "
                                f"CapacityRejected + EnqueueRejected + Admitted = {hit_sum}")
            if not g["reused_tokens"] <= g["admitted_tokens"] <= g["queried_tokens"]:
                findings.append(f"snapshot {lab}: expected reused {g['reused_tokens']} <= "
                                f"admitted {g['admitted_tokens']} <= queried "
                                f"{g['queried_tokens']} tokens")
    if snaps:
        evaluated.append(f"pool occupancy in {len(snaps)} snapshots")
        if all(all(k in s["state"] for k in REUSE_KEYS.values()) for s in snaps):
            evaluated.append("reuse counter identities")
        else:
            not_evaluated.append("reuse counter identities: the server reports no reuse counters")
    # across the run: deltas between the first and the last snapshot of each server
    # lifetime (one unless the harness restarted the server), summed
    exclusive = p.packet["provenance"]["server"]["exclusive"]
    lifetimes = server_lifetimes(snaps)
    for life in lifetimes[1:]:
        st, lab = life[0]["state"], life[0]["label"]
        if any(st.get(k, 0) for k in RESTART_COUNTERS):
            findings.append(f"snapshot {lab}: a restarted server's first snapshot counts "
                            f"{sum(st.get(k, 0) for k in RESTART_COUNTERS)} finished or "
                            f"aborted requests (expected 0)")
    if len(snaps) >= 2 and exclusive and any(len(life) < 2 for life in lifetimes):
        not_evaluated.append("counters across the run: a server lifetime has a single "
                             "snapshot")
    elif len(snaps) >= 2 and exclusive:
        def delta(key: str) -> int | None:
            if not all(key in life[0]["state"] and key in life[-1]["state"]
                       for life in lifetimes):
                return None
            return sum(life[-1]["state"][key] - life[0]["state"][key] for life in lifetimes)

        reached = [_reached_engine(o) for o in obs]
        d_fin, d_abort = delta("requests_finished_total"), delta("requests_aborted_total")
        if d_fin is None or d_abort is None:
            not_evaluated.append("requests across the run: no request counters")
        elif None in reached:
            not_evaluated.append("requests across the run: some failures cannot be placed "
                                 "(no HTTP status)")
        elif not all(life[-1]["idle"] for life in lifetimes):
            not_evaluated.append("requests across the run: the server was not idle at the end"
                                 + (" of a lifetime" if len(lifetimes) > 1 else ""))
        else:
            expect = sum(1 for r in reached if r)
            if d_fin + d_abort != expect:
                findings.append(f"across the run: finished {d_fin} + aborted {d_abort} != "
                                f"{expect} requests that reached the engine")
            n_ok = sum(1 for o in obs if o["status"] == "ok")
            if d_fin < n_ok:
                findings.append(f"across the run: {d_fin} requests finished but {n_ok} "
                                f"completed at the client")
            evaluated.append("request counters across the run")
        d_lookups = delta(REUSE_KEYS["lookups"])
        if d_lookups is not None and n_reuse:
            if d_lookups < n_reuse:
                findings.append(f"across the run: {d_lookups} lookups counted, {n_reuse} "
                                f"requests reported one")
            outs = Counter(o["reuse"]["outcome"] for o in obs if o["reuse"])
            for k, n in outs.items():
                d = delta(REUSE_KEYS[k])
                if d is not None and d < n:
                    findings.append(f"across the run: {d} {k} counted, {n} requests "
                                    f"reported it")
            evaluated.append("reuse counters across the run")
    elif not exclusive:
        not_evaluated.append("counters across the run: the server was not the harness's alone")
    if findings:
        status, msg = FAIL, "counters are not conserved"
    elif missing or not evaluated:
        status, msg = INCONCLUSIVE, "no counter evidence to check"
        findings = missing
    else:
        status, msg = PASS, "counters are conserved: " + "; ".join(evaluated)
    return CheckResult("counter-conservation", status, msg, findings, not_evaluated,
                       {"evaluated": evaluated})


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
        return _not_run("summary-agreement", "observations.jsonl or summary.json")
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
    return _result("summary-agreement", findings, FAIL,
                   "the summary names these observations (sha256) and equals the "
                   "recomputation from them exactly",
                   "the summary disagrees with the raw observations",
                   evidence={"observations_sha256": digest,
                             "summary_observations_sha256": claimed_binding["sha256"],
                             "comparison": "exact",
                             "groups": sorted(recomputed["groups"])})


# --------------------------------------------------------------------------- 9. group outcomes


def check_group_outcomes(p: Packet, opts: Options) -> CheckResult:
    if p.observations is None:
        return _not_run("group-outcomes", "observations.jsonl")
    group = [o for o in p.observations if o["group"] == opts.group]
    if not group:
        return CheckResult("group-outcomes", INCONCLUSIVE,
                           f"group {opts.group!r} has no observation", [])
    bad = [f"{o['request_id']}: {o['status']}"
           + (f" ({o['error']['message'][:120]})" if o["error"] else "")
           for o in group if o["status"] != "ok"]
    return _result("group-outcomes", bad, FAIL,
                   f"all {len(group)} requests of group {opts.group!r} completed",
                   f"requests of group {opts.group!r} failed or were cancelled: the metric "
                   f"would only describe the survivors",
                   evidence={"group": opts.group, "observations": len(group)})


# --------------------------------------------------------------------------- 10. thresholds


def check_thresholds(metric: dict[str, Any] | None, opts: Options) -> CheckResult:
    if opts.max_ms is None:
        return CheckResult("thresholds", NOT_APPLICABLE, "no threshold given")
    if metric is None or metric["value"] is None:
        return CheckResult("thresholds", INCONCLUSIVE,
                           f"threshold {opts.max_ms} ms given but the metric has no value", [])
    value_ms = metric["value"] / 1e6
    ok = value_ms <= opts.max_ms
    return CheckResult("thresholds", PASS if ok else FAIL,
                       f"{metric['name']} = {value_ms:.3f} ms "
                       f"{'<=' if ok else '>'} {opts.max_ms} ms",
                       [] if ok else [f"{metric['name']} {value_ms:.3f} ms exceeds "
                                      f"{opts.max_ms} ms"],
                       evidence={"value_ms": value_ms, "max_ms": opts.max_ms})


# --------------------------------------------------------------------------- 11. identities


def check_identities(p: Packet, opts: Options) -> CheckResult:
    """With --package / --corpus: the packet's package_id, manifest and corpus digests equal
    those of the files given."""
    if opts.package is None and opts.corpus is None:
        return CheckResult("identities", NOT_APPLICABLE, "no --package or --corpus given")
    if p.packet is None:
        return _not_run("identities", PACKET_FILE)
    prov = p.packet["provenance"]
    findings: list[str] = []
    missing: list[str] = []
    if opts.package is not None:
        mpath = Path(opts.package) / "manifest.json"
        data = _read(mpath)
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
        data = _read(Path(opts.corpus))
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
