"""Counters: the server's reuse and request counters are conserved across snapshots and
server lifetimes (a restart starts them again at 0).

See docs/evidence.md for each check's findings and status.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from flare.evidence.checks.base import (FAIL, INCONCLUSIVE, PASS,
                                        CheckResult, Packet, not_run)


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
        return not_run("counter-conservation", "packet.json or observations.jsonl")
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
