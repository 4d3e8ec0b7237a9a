"""The report of a soak (bench/soak.py): requests by outcome, latency quantiles, the
server's RSS over time and the KV pool before and after, with the checks that fail it."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any


@dataclass
class Record:
    """One request of the soak, as the report counts it."""

    kind: str
    outcome: str  # ok, aborted, refused (expected 4xx), or a failure label
    latency_s: float
    ttft_s: float | None = None
    detail: str = ""


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values` by nearest rank; nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


FAILURE_PREFIXES = ("http_5", "stream_server_error", "stream_error", "client_",
                    "refused_without", "stream_cut")


def report(records: list[Record], url: str, model: str,
           rss_samples: list[tuple[float, int, int]], before: dict, after: dict,
           elapsed_s: float, rss_bound_mb: float, warmup_s: float
           ) -> tuple[str, dict, list[str]]:
    """The printed report, its figures as a dict, and the failed checks.

    `rss_samples` are (seconds since the start, server RSS, host tier bytes); `before` and
    `after` the server's /debug/state around the traffic.

    The RSS check compares the end with the first sample after `warmup_s` (first requests
    allocate the runtime's working memory once) and discounts what the host tier holds
    more at the end (its growth up to its budget is by design)."""
    mb = 1024 * 1024
    by = Counter((r.kind, r.outcome) for r in records)
    outcomes = Counter(r.outcome for r in records)
    lines = [f"soak: {len(records)} requests in {elapsed_s:.0f} s against {url} "
             f"({model})", "", "requests by kind and outcome:"]
    for (kind, outcome), n in sorted(by.items()):
        lines.append(f"  {kind:<12} {outcome:<28} {n:>6}")
    lines.append("outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    disconnects = outcomes.get("aborted", 0)
    lines.append(f"client disconnects: {disconnects} "
                 f"({100 * disconnects / max(1, len(records)):.0f}% of requests)")

    lines += ["", "latency of completed requests (s):  p50    p99    n"]
    lat: dict[str, list[float]] = defaultdict(list)
    for r in records:
        if r.outcome == "ok":
            lat[r.kind].append(r.latency_s)
            lat["all"].append(r.latency_s)
    for kind in ["all", *sorted(k for k in lat if k != "all")]:
        v = lat[kind]
        lines.append(f"  {kind:<32} {pct(v, .5):6.2f} {pct(v, .99):6.2f} {len(v):5}")
    ttft = [r.ttft_s for r in records if r.kind == "stream" and r.ttft_s is not None]
    lines.append(f"  {'stream TTFT':<32} {pct(ttft, .5):6.2f} {pct(ttft, .99):6.2f} {len(ttft):5}")

    figures: dict[str, Any] = {
        "requests": len(records), "elapsed_s": round(elapsed_s, 1),
        "outcomes": dict(outcomes), "by_kind": {f"{k}/{o}": n for (k, o), n in by.items()},
        "disconnects": disconnects,
        "latency_p50_s": pct(lat["all"], .5), "latency_p99_s": pct(lat["all"], .99),
        "ttft_p50_s": pct(ttft, .5), "ttft_p99_s": pct(ttft, .99),
    }
    failures = [f"{n} request(s) with outcome {o}" for o, n in sorted(outcomes.items())
                if o.startswith(FAILURE_PREFIXES)]

    if rss_samples:
        values = [v for _, v, _ in rss_samples]
        start, peak, end = values[0], max(values), values[-1]
        warm = next((x for x in rss_samples if x[0] >= warmup_s), rss_samples[-1])
        growth = (end - warm[1] - (rss_samples[-1][2] - warm[2])) / mb
        step = max(1, len(rss_samples) // 10)
        series = ", ".join(f"{t:.0f}s {v / mb:.0f}" for t, v, _ in rss_samples[::step])
        lines += ["", f"server RSS (MiB): start {start / mb:.0f}, max {peak / mb:.0f}, "
                      f"end {end / mb:.0f}; after the {warmup_s:g} s warm-up "
                      f"{warm[1] / mb:.0f}, growth since {growth:+.0f} "
                      f"(host tier now {rss_samples[-1][2] / mb:.0f})",
                  f"  over time: {series}"]
        figures |= {"rss_start_mib": round(start / mb), "rss_max_mib": round(peak / mb),
                    "rss_end_mib": round(end / mb), "rss_after_warmup_mib": round(warm[1] / mb),
                    "rss_growth_after_warmup_mib": round(growth),
                    "host_tier_end_mib": round(rss_samples[-1][2] / mb)}
        if growth > rss_bound_mb:
            failures.append(f"RSS grew {growth:.0f} MiB after the warm-up "
                            f"(bound {rss_bound_mb:g})")
    else:
        lines += ["", "server RSS: not sampled (no --pid and none found for the port)"]

    def pool(st: dict) -> str:
        held = st["pages_used"] - st.get("prefix_cache_pages", 0)
        return (f"used {st['pages_used']}, free {st['pages_free']}, of {st['pages_total']}; "
                f"prefix cache {st.get('prefix_cache_pages', 0)}, held by requests {held}; "
                f"running {st['num_running']}, waiting {st['num_waiting']}")

    held_after = after["pages_used"] - after.get("prefix_cache_pages", 0)
    aborted = after.get("requests_aborted_total", 0) - before.get("requests_aborted_total", 0)
    lines += ["", f"KV pool before: {pool(before)}", f"KV pool after:  {pool(after)}",
              f"engine: {aborted} requests aborted, "
              f"{after.get('failed_steps_total', 0) - before.get('failed_steps_total', 0)} "
              f"failed steps during the soak"]
    figures |= {"pages_total": after["pages_total"], "pages_used_end": after["pages_used"],
                "prefix_cache_pages_end": after.get("prefix_cache_pages", 0),
                "pages_held_by_requests_end": held_after,
                "pages_held_by_requests_baseline":
                    before["pages_used"] - before.get("prefix_cache_pages", 0),
                "engine_aborted": aborted}
    if held_after != 0:
        failures.append(f"{held_after} pages still held by requests after the traffic")
    if after["num_running"] or after["num_waiting"]:
        failures.append("requests still running or waiting after the traffic")
    if after["pages_used"] + after["pages_free"] != after["pages_total"]:
        failures.append("pages used + free != total")
    if after.get("failed_steps_total", 0) != before.get("failed_steps_total", 0):
        failures.append("engine steps failed during the soak")
    lines += ["", "checks: " + ("PASS" if not failures else "FAIL: " + "; ".join(failures))]
    return "\n".join(lines), figures, failures
