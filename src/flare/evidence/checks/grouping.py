"""Grouping: per-group outcomes, and the thresholds a caller gave.

See docs/evidence.md for each check's findings and status.
"""

from __future__ import annotations

from typing import Any

from flare.evidence.checks.base import (FAIL, INCONCLUSIVE, NOT_APPLICABLE, PASS,
                                        CheckResult, Options, Packet, make_result, not_run)


# --------------------------------------------------------------------------- 9. group outcomes


def check_group_outcomes(p: Packet, opts: Options) -> CheckResult:
    if p.observations is None:
        return not_run("group-outcomes", "observations.jsonl")
    group = [o for o in p.observations if o["group"] == opts.group]
    if not group:
        return CheckResult("group-outcomes", INCONCLUSIVE,
                           f"group {opts.group!r} has no observation", [])
    bad = [f"{o['request_id']}: {o['status']}"
           + (f" ({o['error']['message'][:120]})" if o["error"] else "")
           for o in group if o["status"] != "ok"]
    return make_result("group-outcomes", bad, FAIL,
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
