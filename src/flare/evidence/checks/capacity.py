"""Capacity: what the packet claims about the plan and pools agrees with the server's
own snapshots.

See docs/evidence.md for each check's findings and status.
"""

from __future__ import annotations

from typing import Any

from flare.evidence.schema import (
    PACKET_FILE,
)
from flare.evidence.checks.base import (FAIL, INCONCLUSIVE, PASS,
                                        CheckResult, Packet, not_run)


# --------------------------------------------------------------------------- 6. capacity

PLAN_KEYS = ("max_seq_len", "max_num_seqs", "page_size", "num_pages", "max_batch_tokens", "dtype")


def capacity_label(claimed: dict[str, Any]) -> str:
    """The label of a capacity: "k=v" for each plan key, space separated, in PLAN_KEYS order."""
    return " ".join(f"{k}={claimed[k]}" for k in PLAN_KEYS)


def check_capacity(p: Packet) -> CheckResult:
    if p.packet is None:
        return not_run("capacity", PACKET_FILE)
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
