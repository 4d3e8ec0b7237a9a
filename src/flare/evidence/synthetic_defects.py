"""The synthetic packet with one defect, one per way a packet can be wrong (`DEFECTS`:
each names the verdict and the check that must report it), and `build`, which writes the
packet as `flare.evidence.synthetic` makes it or with one of them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flare.evidence import recompute
from flare.evidence.checks import capacity_label
from flare.evidence.clocks import CLIENT, SERVER
from flare.evidence.schema import OBSERVATIONS_FILE, SUMMARY_FILE
from flare.evidence.synthetic import parts, state_counts, write


def _find(obs: list[dict], pred: Callable[[dict], bool]) -> dict:
    return next(o for o in obs if pred(o))


def _drop_request(packet: dict, obs: list[dict], rid: str) -> list[dict]:
    for sc in packet["scenarios"]:
        if rid in sc["request_ids"]:
            sc["request_ids"].remove(rid)
    return [o for o in obs if o["request_id"] != rid]


def _d_missing_observations(folder, packet, obs):
    write(folder, packet, obs)
    (folder / OBSERVATIONS_FILE).unlink()


def _d_missing_group(folder, packet, obs):
    obs = [o for o in obs if o["group"] != "ttft-512"]
    packet["scenarios"] = [s for s in packet["scenarios"] if s["name"] != "ttft-512"]
    packet["requests_sent"] = len(obs)
    packet["server_state"][-1]["state"].update(state_counts(obs, True))
    write(folder, packet, obs)


def _d_too_few_samples(folder, packet, obs):
    for rid in [o["request_id"] for o in obs if o["group"] == "ttft-512"][2:]:
        obs = _drop_request(packet, obs, rid)
    packet["requests_sent"] = len(obs)
    packet["server_state"][-1]["state"].update(state_counts(obs, True))
    write(folder, packet, obs)


def _d_dropped_failed(folder, packet, obs):
    # the observation is gone but the packet still says the request was sent
    failed = _find(obs, lambda o: o["status"] == "failed")
    obs = [o for o in obs if o is not failed]
    write(folder, packet, obs)


def _d_clock_mixed(folder, packet, obs):
    summary = recompute.summarize(obs)
    block = summary["groups"]["ttft-512"]["ttft_server_ns"]
    block["from"] = "client.send_ns"  # a server first-token time minus a client send time
    write(folder, packet, obs, summary)


def _d_clock_mislabelled(folder, packet, obs):
    o = _find(obs, lambda o: o["server"] is not None and o["group"] == "device-hit")
    o["server"]["clock"] = CLIENT
    summary = _summary_without_check(obs)
    write(folder, packet, obs, summary)


def _summary_without_check(obs: list[dict]) -> dict:
    """Summary computed as if the labels were right (a harness that did not look)."""
    fixed = copy.deepcopy(obs)
    for o in fixed:
        o["client"]["clock"] = CLIENT
        if o["server"] is not None:
            o["server"]["clock"] = SERVER
    return recompute.summarize(fixed)


def _d_clock_backwards(folder, packet, obs):
    o = _find(obs, lambda o: o["group"] == "miss" and o["status"] == "ok")
    o["client"]["events"][1]["t_ns"] = o["client"]["send_ns"] - 1_000
    write(folder, packet, obs)


def _d_coalesced_expanded(folder, packet, obs):
    o = _find(obs, lambda o: any(e["tokens"] == 2 for e in o["client"]["events"]))
    evs = o["client"]["events"]
    i = next(i for i, e in enumerate(evs) if e["tokens"] == 2)
    e = evs[i]
    evs[i:i + 1] = [{**e, "tokens": 1, "chars": e["chars"] // 2},
                    {**e, "tokens": 1, "chars": e["chars"] - e["chars"] // 2}]
    write(folder, packet, obs)


def _d_itl_invented(folder, packet, obs):
    summary = recompute.summarize(obs)
    summary["groups"]["ttft-512"]["itl_client_ns"]["n"] += 1  # one more interval than exist
    write(folder, packet, obs, summary)


def _d_capacity_mismatch(folder, packet, obs):
    cap = packet["capacity"]
    cap["claimed"]["num_pages"] = 2048  # a bigger pool than the package and server have
    cap["label"] = capacity_label(cap["claimed"])
    write(folder, packet, obs)


def _d_capacity_changed(folder, packet, obs):
    st = packet["server_state"][-1]["state"]
    st["pages_total"] = 512
    st["pages_free"] = 512 - st["pages_used"]
    write(folder, packet, obs)


def _d_counters_not_conserved(folder, packet, obs):
    packet["server_state"][-1]["state"]["reuse_lookups_total"] += 1
    write(folder, packet, obs)


def _d_reuse_exceeds_prompt(folder, packet, obs):
    o = _find(obs, lambda o: o["reuse"] and o["reuse"]["outcome"] == "Admitted")
    n = o["usage"]["prompt_tokens"] + 16
    o["reuse"].update(matched_tokens=n, reused_tokens=n)
    o["usage"]["cached_tokens"] = n
    write(folder, packet, obs)


def _d_summary_disagrees(folder, packet, obs):
    summary = recompute.summarize(obs)
    summary["groups"]["ttft-512"]["ttft_client_ns"]["median"] -= 5_000_000  # a nicer figure
    write(folder, packet, obs, summary)


def _one_ns_moves(obs: list[dict]) -> list[tuple[dict, int, int]]:
    """Every 1-ns move of a token-carrying event's receive time that keeps the client clock
    monotonic and no two token events at one time: (observation, event index, +1 or -1)."""
    out = []
    for o in obs:
        evs = o["client"]["events"]
        times = [o["client"]["send_ns"]] + [e["t_ns"] for e in evs] + [o["client"]["end_ns"]]
        for j, e in enumerate(evs):
            if not recompute.carries_tokens(e):
                continue
            for d in (1, -1):
                if times[j] < e["t_ns"] + d < times[j + 2]:
                    out.append((o, j, d))
    return out


def _figure_changes(before: dict, after: dict, path: str = "") -> list[tuple[str, Any, Any]]:
    if isinstance(before, dict) and isinstance(after, dict):
        return [c for k in sorted(set(before) | set(after))
                for c in _figure_changes(before.get(k), after.get(k), f"{path}.{k}")]
    return [] if before == after else [(path, before, after)]


def _move_one_ns(obs: list[dict], keep: Callable[[list[tuple[str, Any, Any]]], bool]) -> None:
    """Move the receive time of the first token-carrying event (in observation order) whose
    1-ns move changes the summary's figures in a way `keep` accepts."""
    before = recompute.summarize(obs)["groups"]
    for o, j, d in _one_ns_moves(obs):
        o["client"]["events"][j]["t_ns"] += d
        if keep(_figure_changes(before, recompute.summarize(obs)["groups"])):
            return
        o["client"]["events"][j]["t_ns"] -= d
    raise AssertionError("no 1-ns move of the kind asked for in the synthetic packet")


def _d_resealed_1ns(folder, packet, obs):
    # the raw data is edited after the harness summarized it, packet.json resealed, the
    # harness's summary kept; the move changes no figure at all: only the binding shows it
    summary = recompute.summarize(obs)
    _move_one_ns(obs, lambda changes: not changes)
    write(folder, packet, obs, summary)


def _d_rebound_half_ns(folder, packet, obs):
    # as above, and the summary's binding recomputed too, keeping its figures: the move
    # changes one median by half a nanosecond and nothing else
    summary = recompute.summarize(obs)
    _move_one_ns(obs, lambda changes: len(changes) == 1 and changes[0][0].endswith(".median")
                 and abs(changes[0][1] - changes[0][2]) == 0.5)
    summary["observations"] = recompute.summarize(obs)["observations"]
    write(folder, packet, obs, summary)


def _d_truncated_jsonl(folder, packet, obs):
    write(folder, packet, obs)
    path = folder / OBSERVATIONS_FILE
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])  # cut inside the last line


def _d_edited_unsealed(folder, packet, obs):
    write(folder, packet, obs)
    path = folder / SUMMARY_FILE
    path.write_bytes(path.read_bytes().replace(b'"total": 6', b'"total": 7', 1))


def _d_group_request_failed(folder, packet, obs):
    o = _find(obs, lambda o: o["group"] == "ttft-512")
    o["status"] = "failed"
    o["error"] = {"http_status": 200, "type": "server_error", "message": "engine step failed"}
    for s in packet["server_state"][1:]:
        s["state"]["requests_finished_total"] -= 1
        s["state"]["requests_aborted_total"] += 1
    write(folder, packet, obs)


def _d_no_capacity_evidence(folder, packet, obs):
    cap = packet["capacity"]
    cap["plan"] = cap["memory_report"] = cap["kv_layout"] = None
    packet["server_state"] = []
    write(folder, packet, obs)


# name -> (expected verdict, check that must report it, builder, what it is)
DEFECTS: dict[str, tuple[str, str, Callable, str]] = {
    "missing-observations": ("INCONCLUSIVE", "completeness", _d_missing_observations,
                             "observations.jsonl is missing"),
    "missing-group": ("INCONCLUSIVE", "completeness", _d_missing_group,
                      "no ttft-512 group"),
    "too-few-samples": ("INCONCLUSIVE", "completeness", _d_too_few_samples,
                        "ttft-512 has 2 samples, fewer than the minimum"),
    "dropped-failed-request": ("INCONCLUSIVE", "completeness", _d_dropped_failed,
                               "a failed request's observation was dropped"),
    "clock-mixed": ("FAIL", "clock-domains", _d_clock_mixed,
                    "the summary subtracts a client time from a server time"),
    "clock-mislabelled": ("INCONCLUSIVE", "clock-domains", _d_clock_mislabelled,
                          "server timings labelled with the client clock"),
    "clock-backwards": ("INCONCLUSIVE", "clock-domains", _d_clock_backwards,
                        "an event received before its request was sent"),
    "coalesced-expanded": ("FAIL", "coalesced-events", _d_coalesced_expanded,
                           "a 2-token event split into two 1-token events at one time"),
    "itl-invented": ("FAIL", "coalesced-events", _d_itl_invented,
                     "the summary's ITL counts more intervals than single-token events give"),
    "capacity-mismatch": ("FAIL", "capacity", _d_capacity_mismatch,
                          "the claimed pool is twice the package's and the server's"),
    "capacity-changed": ("FAIL", "capacity", _d_capacity_changed,
                         "the server's pool size changed during the run"),
    "counters-not-conserved": ("FAIL", "counter-conservation", _d_counters_not_conserved,
                               "lookups != NoMatch + hits"),
    "reuse-exceeds-prompt": ("FAIL", "counter-conservation", _d_reuse_exceeds_prompt,
                             "a request reused more tokens than its prompt has"),
    "summary-disagrees": ("FAIL", "summary-agreement", _d_summary_disagrees,
                          "the summary's median TTFT is 5 ms better than the raw data"),
    "resealed-1ns-move": ("FAIL", "summary-agreement", _d_resealed_1ns,
                          "an event's receive time moved by 1 ns after the summary was "
                          "written, packet resealed (no figure changes: the binding does)"),
    "rebound-half-ns-median": ("FAIL", "summary-agreement", _d_rebound_half_ns,
                               "a 1-ns move, packet resealed and the summary's binding "
                               "recomputed; one median is 0.5 ns off the summary's"),
    "truncated-jsonl": ("INCONCLUSIVE", "schema", _d_truncated_jsonl,
                        "observations.jsonl cut inside its last line"),
    "edited-unsealed": ("INCONCLUSIVE", "integrity", _d_edited_unsealed,
                        "summary.json edited after the packet was sealed"),
    "group-request-failed": ("FAIL", "group-outcomes", _d_group_request_failed,
                             "a request of the metric's group failed"),
    "no-capacity-evidence": ("INCONCLUSIVE", "capacity", _d_no_capacity_evidence,
                             "no plan, memory report or server state in the packet"),
}


def build(folder: Path, defect: str | None = None, seed: int = 7) -> Path:
    """Write the synthetic packet into `folder` (created), with `defect` when given."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    packet, obs = parts(seed)
    if defect is None:
        write(folder, packet, obs)
    else:
        DEFECTS[defect][2](folder, packet, obs)
    return folder
