"""Figures recomputed from raw observations: the metric definitions, in one place.

The harness (`flare qualify`) writes its `summary.json` with `summarize`, and the verifier
recomputes the same figures from `observations.jsonl` to compare: a summary is a claim,
the observations are the evidence.

Definitions (all durations in ns, each inside one clock domain, see `clocks`):
- token-carrying event: an SSE event of the observation whose `tokens` is >= 1; when the
  packet has no token counts (`tokens` null), a `content` event with at least one
  character (a non-empty delta always carries at least one token).
- `ttft_client_ns`: first token-carrying event's receive time minus the request's send
  time (client clock). Observations without a token-carrying event give no sample.
- `itl_client_ns`: for each token-carrying event after the first that carries exactly one
  token, its receive time minus the previous token-carrying event's receive time (client
  clock). An event carrying several tokens (coalesced) gives no sample: its tokens share
  one receive time and no per-token time is invented. Without token counts: no samples.
- `e2e_client_ns`: last event's receive time minus send time (client clock), for `ok`
  observations.
- `ttft_server_ns`: `first_token_ns - arrival_ns` (server clock), when the server
  reported its timings.
- `queue_server_ns`: `scheduled_ns - arrival_ns` (server clock).
- median: `statistics.median` (mean of the two middle values for an even count);
  p90: nearest rank, the ceil(0.9 n)-th smallest value; sum: exact total of the samples.
  No samples: every statistic null.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from flare.evidence.clocks import CLIENT, SERVER, ClockDomainError, Stamp, span
from flare.evidence.schema import SUMMARY_SCHEMA, SUMMARY_SCHEMA_VERSION, observations_sha256

REUSE_OUTCOMES = ("NoMatch", "CostRejected", "CapacityRejected", "EnqueueRejected", "Admitted")

# Every duration metric: its clock domain and the two field paths it subtracts.
METRIC_DEFS: dict[str, dict[str, str]] = {
    "ttft_client_ns": {"clock": CLIENT, "from": "client.send_ns",
                       "to": "client.events[first token-carrying].t_ns"},
    "itl_client_ns": {"clock": CLIENT, "from": "client.events[previous token-carrying].t_ns",
                      "to": "client.events[token-carrying, exactly 1 token].t_ns"},
    "e2e_client_ns": {"clock": CLIENT, "from": "client.send_ns",
                      "to": "client.events[last].t_ns"},
    "ttft_server_ns": {"clock": SERVER, "from": "server.timings.arrival_ns",
                       "to": "server.timings.first_token_ns"},
    "queue_server_ns": {"clock": SERVER, "from": "server.timings.arrival_ns",
                        "to": "server.timings.scheduled_ns"},
}

DEFINITIONS = {
    "ttft_client_ns": "receive time of the first SSE event carrying at least one token minus "
                      "the request's send time, both client clock (time.monotonic_ns in the "
                      "harness); requests without such an event give no sample",
    "itl_client_ns": "receive time of a token-carrying event that carries exactly one token "
                     "minus that of the previous token-carrying event (client clock); "
                     "coalesced events give no sample",
    "e2e_client_ns": "receive time of the last SSE event minus send time (client clock), ok "
                     "requests only",
    "ttft_server_ns": "server first_token_ns minus server arrival_ns (server clock)",
    "queue_server_ns": "server scheduled_ns minus server arrival_ns (server clock)",
}

# Metrics `flare evidence verify --metric` can select: name -> (duration, statistic).
SELECTABLE = {
    "ttft-client-median": ("ttft_client_ns", "median"),
    "ttft-client-p90": ("ttft_client_ns", "p90"),
    "itl-client-median": ("itl_client_ns", "median"),
    "ttft-server-median": ("ttft_server_ns", "median"),
}
DEFAULT_METRIC = "ttft-client-median"
DEFAULT_GROUP = "ttft-512"


# --------------------------------------------------------------------------- stamps


def _stamp(obs: dict[str, Any], ns: int, block: str, clock: str) -> Stamp:
    """A stamp on `clock` of `obs`, after checking that its `block` is labelled so.

    Raises:
        ClockDomainError: the block names another clock (or none).
    """
    label = (obs.get(block) or {}).get("clock")
    if label != clock:
        raise ClockDomainError(f"observation {obs.get('request_id')!r}: {block} block is "
                               f"labelled {label!r}, expected {clock!r}")
    return Stamp(clock, ns)


def client_stamp(obs: dict[str, Any], ns: int) -> Stamp:
    """A client-clock stamp of `obs`, after checking its client block's label."""
    return _stamp(obs, ns, "client", CLIENT)


def server_stamp(obs: dict[str, Any], ns: int) -> Stamp:
    """A server-clock stamp of `obs`, after checking its server block's label."""
    return _stamp(obs, ns, "server", SERVER)


# --------------------------------------------------------------------------- per observation


def carries_tokens(event: dict[str, Any]) -> bool:
    tokens = event.get("tokens")
    if tokens is None:
        return event.get("type") == "content" and (event.get("chars") or 0) > 0
    return tokens >= 1


def token_events(obs: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in obs["client"]["events"] if carries_tokens(e)]


def ttft_client_ns(obs: dict[str, Any]) -> int | None:
    events = token_events(obs)
    if not events:
        return None
    return span(client_stamp(obs, obs["client"]["send_ns"]), client_stamp(obs, events[0]["t_ns"]))


def itl_client_ns(obs: dict[str, Any]) -> list[int]:
    events = token_events(obs)
    out = []
    for prev, cur in zip(events, events[1:]):
        if cur.get("tokens") == 1:
            out.append(span(client_stamp(obs, prev["t_ns"]), client_stamp(obs, cur["t_ns"])))
    return out


def e2e_client_ns(obs: dict[str, Any]) -> int | None:
    events = obs["client"]["events"]
    if obs.get("status") != "ok" or not events:
        return None
    return span(client_stamp(obs, obs["client"]["send_ns"]), client_stamp(obs, events[-1]["t_ns"]))


def _server_span(obs: dict[str, Any], start: str, end: str) -> int | None:
    server = obs.get("server")
    if not server:
        return None
    timings = server.get("timings") or {}
    a, b = timings.get(start), timings.get(end)
    if a is None or b is None:
        return None
    return span(server_stamp(obs, a), server_stamp(obs, b))


def ttft_server_ns(obs: dict[str, Any]) -> int | None:
    return _server_span(obs, "arrival_ns", "first_token_ns")


def queue_server_ns(obs: dict[str, Any]) -> int | None:
    return _server_span(obs, "arrival_ns", "scheduled_ns")


def samples(obs_list: Iterable[dict[str, Any]], metric: str) -> list[int]:
    """Every sample of duration `metric` (a METRIC_DEFS key) over `obs_list`."""
    out: list[int] = []
    for obs in obs_list:
        if metric == "itl_client_ns":
            out.extend(itl_client_ns(obs))
            continue
        fn = {"ttft_client_ns": ttft_client_ns, "e2e_client_ns": e2e_client_ns,
              "ttft_server_ns": ttft_server_ns, "queue_server_ns": queue_server_ns}[metric]
        value = fn(obs)
        if value is not None:
            out.append(value)
    return out


# --------------------------------------------------------------------------- statistics


def p90(values: Sequence[int]) -> int | None:
    """Nearest-rank 90th percentile: the ceil(0.9 n)-th smallest value."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(1, math.ceil(0.9 * len(ordered))) - 1]


def median(values: Sequence[int]) -> float | int | None:
    if not values:
        return None
    m = statistics.median(values)
    return int(m) if float(m).is_integer() else float(m)


def stats(values: Sequence[int]) -> dict[str, Any]:
    """{n, median, p90, min, max, sum}; all statistics null (never 0) when there is no
    sample. `sum` (exact, ns) makes a change to any one sample visible in the summary."""
    return {"n": len(values), "median": median(values), "p90": p90(values),
            "min": min(values) if values else None, "max": max(values) if values else None,
            "sum": sum(values) if values else None}


def metric_block(name: str, values: Sequence[int]) -> dict[str, Any]:
    return {**METRIC_DEFS[name], **stats(values)}


# --------------------------------------------------------------------------- summary


def _sum_or_none(values: list[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def group_summary(obs_list: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of one group of observations (see `summarize`)."""
    status = Counter(o["status"] for o in obs_list)
    events = [e for o in obs_list for e in o["client"]["events"]]
    token_evs = [e for e in events if carries_tokens(e)]
    with_usage = [o["usage"] for o in obs_list if o.get("usage")]
    with_reuse = [o["reuse"] for o in obs_list if o.get("reuse")]
    outcomes = Counter(r["outcome"] for r in with_reuse)
    return {
        "requests": {"total": len(obs_list), "ok": status.get("ok", 0),
                     "failed": status.get("failed", 0), "cancelled": status.get("cancelled", 0)},
        **{name: metric_block(name, samples(obs_list, name)) for name in METRIC_DEFS},
        "events": {
            "total": len(events),
            "token_carrying": len(token_evs),
            # None when the packet has no token counts: unknown, not zero
            "coalesced": (sum(1 for e in token_evs if (e.get("tokens") or 0) > 1)
                          if all(e.get("tokens") is not None for e in token_evs) else None),
            "tokens": _sum_or_none([e.get("tokens") for e in token_evs])
            if all(e.get("tokens") is not None for e in token_evs) else None,
        },
        "usage": {
            "n": len(with_usage),
            "prompt_tokens": _sum_or_none([u.get("prompt_tokens") for u in with_usage]),
            "completion_tokens": _sum_or_none([u.get("completion_tokens") for u in with_usage]),
            "cached_tokens": _sum_or_none([u.get("cached_tokens") for u in with_usage]),
        },
        "reuse": {
            "n": len(with_reuse),
            "outcomes": {k: outcomes.get(k, 0) for k in REUSE_OUTCOMES} if with_reuse else None,
            "matched_tokens": _sum_or_none([r.get("matched_tokens") for r in with_reuse]),
            "reused_tokens": _sum_or_none([r.get("reused_tokens") for r in with_reuse]),
        },
    }


def group_names(observations: Iterable[dict[str, Any]]) -> list[str]:
    """Group names in order of first appearance."""
    seen: dict[str, None] = {}
    for o in observations:
        seen.setdefault(o["group"], None)
    return list(seen)


def summarize(observations: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of a packet's observations: the sha256 and count of the observations it
    was computed from (`observations`: the binding the verifier recomputes), and per group,
    request counts, every duration metric of METRIC_DEFS ({clock, from, to, n, median, p90,
    min, max, sum}, ns), event and token counts, usage sums and reuse outcomes.

    Raises:
        ClockDomainError: an observation's client or server block carries the wrong clock
            label (the harness refuses to summarize mixed data).
    """
    groups = {name: group_summary([o for o in observations if o["group"] == name])
              for name in group_names(observations)}
    return {"schema": SUMMARY_SCHEMA, "schema_version": SUMMARY_SCHEMA_VERSION,
            "statistics": {"median": "statistics.median (mean of the two middle values)",
                           "p90": "nearest rank: ceil(0.9 n)-th smallest"},
            "observations": {"sha256": observations_sha256(observations),
                             "count": len(observations)},
            "groups": groups}


def select_metric(name: str, observations: list[dict[str, Any]], group: str) -> dict[str, Any]:
    """Recompute selectable metric `name` (SELECTABLE) over `group`'s observations.

    Returns:
        {name, duration, statistic, unit, clock, from, to, group, n_samples,
         n_observations, value}; value is None without samples.
    """
    duration, statistic = SELECTABLE[name]
    obs = [o for o in observations if o["group"] == group]
    values = samples(obs, duration)
    value = median(values) if statistic == "median" else p90(values)
    return {"name": name, "duration": duration, "statistic": statistic, "unit": "ns",
            **METRIC_DEFS[duration], "group": group, "n_observations": len(obs),
            "n_samples": len(values), "value": value}
