"""Synthetic packets: one small valid packet, and one per way a packet can be wrong.

For the verifier's tests and docs. `build(folder)` writes a packet that verifies PASS;
`build(folder, defect)` writes it with one defect from `DEFECTS`, each of which names the
verdict and the check that must report it. Numbers are made up but consistent (capacity of
a 30-layer, 3-KV-head model; counters that add up); nothing here talks to a server.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any, Callable

from flare.evidence import recompute
from flare.evidence.checks import capacity_label
from flare.evidence.clocks import CLIENT, SERVER
from flare.evidence.schema import (
    OBSERVATIONS_FILE,
    PACKET_SCHEMA,
    SCHEMA_VERSION,
    SUMMARY_FILE,
    sha256_bytes,
    write_packet_files,
)

PLAN = {"max_seq_len": 2048, "max_num_seqs": 8, "page_size": 16, "num_pages": 1024,
        "max_batch_tokens": 512, "dtype": "float32"}
KV_LAYOUT = {"kv_only": True, "num_kv_layers": 30, "num_kv_heads": 3, "head_dim": 64,
             "elem_bytes": 4}
_KV_BYTES = PLAN["num_pages"] * PLAN["page_size"] * 2 * 30 * 3 * 64 * 4
MEMORY = {"weights_bytes": 538_000_000, "kv_pool_bytes": _KV_BYTES,
          "workspace_bytes": 12_000_000, "total_bytes": 538_000_000 + _KV_BYTES + 12_000_000,
          "device_bytes": 64 << 30}
PACKAGE_ID = "a" * 64


def _obs(rng: random.Random, seq: int, rid: str, scenario: str, t0: int, *,
         prompt_tokens: int, n_events: int = 4, status: str = "ok", coalesce_at: int | None = None,
         reuse: dict | None = None, session: str | None = None, turn: int | None = None,
         http_status: int | None = None) -> dict[str, Any]:
    """One observation starting at client time t0 (ns)."""
    send = t0
    headers = send + rng.randint(200_000, 400_000)
    t = headers
    events = [{"t_ns": t, "type": "role", "tokens": 0, "chars": 0}]
    tokens_total = 0
    error = None
    finish = None
    if status == "failed" and http_status is not None and http_status != 200:
        events = []
        headers_ns = headers
        end = headers + 50_000
        error = {"http_status": http_status, "type": "invalid_request_error",
                 "message": "This model's maximum context length is 2048 tokens."}
        return _finish_obs(seq, rid, scenario, send, headers_ns, end, [], "failed", error, None,
                           None, None, "the request failed before the server sent timings",
                           None, session, turn, prompt_tokens)
    t += rng.randint(20_000_000, 60_000_000)  # prefill
    for i in range(n_events):
        k = 2 if coalesce_at == i else 1
        events.append({"t_ns": t, "type": "content", "tokens": k, "chars": 3 * k})
        tokens_total += k
        t += rng.randint(8_000_000, 15_000_000)
    if status == "cancelled":
        end = t
        return _finish_obs(seq, rid, scenario, send, headers, end, events, "cancelled",
                           {"http_status": None, "type": "cancelled",
                            "message": "client disconnected after the first token"},
                           None, None, None, "cancelled before the final chunk", None, session,
                           turn, prompt_tokens)
    finish = "length"
    events.append({"t_ns": t, "type": "finish", "tokens": 0, "chars": 0})
    t += 100_000
    events.append({"t_ns": t, "type": "usage", "tokens": 0, "chars": 0})
    t += 50_000
    events.append({"t_ns": t, "type": "done", "tokens": 0, "chars": 0})
    reused = reuse["reused_tokens"] if reuse else 0
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": tokens_total,
             "cached_tokens": reused}
    arrival = 10_000_000_000 + seq * 1_000_000_000
    sched = arrival + rng.randint(10_000, 90_000)
    first = sched + rng.randint(20_000_000, 50_000_000)
    server = {"clock": SERVER, "request_id": f"chatcmpl-{seq:04d}-0",
              "timings": {"arrival_ns": arrival, "scheduled_ns": sched,
                          "first_token_ns": first,
                          "finished_ns": first + 10_000_000 * n_events}}
    return _finish_obs(seq, rid, scenario, send, headers, t, events, "ok", None, finish, usage,
                       server, None, reuse, session, turn, prompt_tokens)


def _finish_obs(seq, rid, scenario, send, headers, end, events, status, error, finish, usage,
                server, server_unavailable, reuse, session, turn, prompt_tokens):
    return {
        "seq": seq, "request_id": rid, "scenario": scenario, "group": scenario,
        "session": session, "turn": turn, "endpoint": "/v1/chat/completions", "stream": True,
        "request": {"max_tokens": 8, "prompt_sha256": sha256_bytes(rid.encode()),
                    "prompt_chars": prompt_tokens * 4, "prompt_tokens_target": None,
                    "messages": 2},
        "status": status, "error": error, "finish_reason": finish,
        "client": {"clock": CLIENT, "send_ns": send, "headers_ns": headers, "end_ns": end,
                   "events": events},
        "usage": usage, "server": server, "server_unavailable": server_unavailable,
        "reuse": reuse, "response_id": f"chatcmpl-{seq:04d}" if status == "ok" else None,
    }


def _state(obs: list[dict[str, Any]], final: bool) -> dict[str, int]:
    """A /debug/state snapshot consistent with `obs` (all zero at the start)."""
    reached = [o for o in obs if o["status"] in ("ok", "cancelled")] if final else []
    outcomes = {k: 0 for k in recompute.REUSE_OUTCOMES}
    admitted = reused = 0
    for o in reached:
        r = o["reuse"] or {"outcome": "NoMatch", "matched_tokens": 0, "reused_tokens": 0}
        outcomes[r["outcome"]] += 1
        if r["outcome"] == "Admitted":
            admitted += r["reused_tokens"]
            reused += r["reused_tokens"]
    hits = sum(outcomes[k] for k in recompute.REUSE_OUTCOMES if k != "NoMatch")
    queried = sum(o["usage"]["prompt_tokens"] if o["usage"] else 100 for o in reached)
    used = 64 if final else 0
    return {
        "num_running": 0, "num_waiting": 0, "pages_total": PLAN["num_pages"],
        "pages_used": used, "pages_free": PLAN["num_pages"] - used, "num_preemptions": 0,
        "requests_finished_total": sum(1 for o in reached if o["status"] == "ok"),
        "requests_aborted_total": sum(1 for o in reached if o["status"] == "cancelled"),
        "reuse_lookups_total": len(reached), "reuse_hits_total": hits,
        "reuse_admitted_tokens_total": admitted, "reuse_reused_tokens_total": reused,
        "prefix_cache_queries_total": queried, "prefix_cache_hits_total": admitted,
        "reuse_outcome_no_match_total": outcomes["NoMatch"],
        "reuse_outcome_cost_rejected_total": outcomes["CostRejected"],
        "reuse_outcome_capacity_rejected_total": outcomes["CapacityRejected"],
        "reuse_outcome_enqueue_rejected_total": outcomes["EnqueueRejected"],
        "reuse_outcome_admitted_total": outcomes["Admitted"],
    }


def parts(seed: int = 7) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A valid packet.json content (not yet sealed) and its observations."""
    rng = random.Random(seed)
    obs: list[dict[str, Any]] = []
    scenarios: dict[str, list[str]] = {}
    t = 1_000_000_000_000

    def add(scenario: str, **kw: Any) -> None:
        nonlocal t
        rid = f"{scenario}/{len(scenarios.setdefault(scenario, [])):03d}"
        o = _obs(rng, len(obs), rid, scenario, t, **kw)
        obs.append(o)
        scenarios[scenario].append(rid)
        t = (o["client"]["end_ns"] or t) + 5_000_000

    nomatch = {"outcome": "NoMatch", "matched_tokens": 0, "reused_tokens": 0}
    for i in range(6):
        add("ttft-512", prompt_tokens=512, n_events=4, coalesce_at=2 if i == 1 else None,
            reuse=dict(nomatch))
    add("miss", prompt_tokens=180, reuse=dict(nomatch))
    add("miss", prompt_tokens=4000, status="failed", http_status=400)
    add("device-hit", prompt_tokens=200, reuse=dict(nomatch), session="d0", turn=0)
    add("device-hit", prompt_tokens=260, session="d0", turn=1,
        reuse={"outcome": "Admitted", "matched_tokens": 205, "reused_tokens": 205})
    add("cancel", prompt_tokens=150, status="cancelled", session="c0", turn=0)
    add("cancel", prompt_tokens=190, session="c0", turn=1,
        reuse={"outcome": "Admitted", "matched_tokens": 144, "reused_tokens": 144})
    for turn in range(3):
        add("agent-session", prompt_tokens=300 + 120 * turn, session="s1", turn=turn,
            reuse=dict(nomatch) if turn == 0 else
            {"outcome": "Admitted", "matched_tokens": 290 + 120 * (turn - 1),
             "reused_tokens": 288 + 120 * (turn - 1)})
    start_ns = obs[0]["client"]["send_ns"] - 1_000_000
    end_ns = obs[-1]["client"]["end_ns"] + 1_000_000
    snaps = [{"label": "start", "client_ns": start_ns, "idle": True, "state": _state(obs, False)},
             {"label": "end", "client_ns": end_ns, "idle": True, "state": _state(obs, True)}]
    sc_list = [{"name": n, "status": "ran", "reason": None, "request_ids": ids}
               for n, ids in scenarios.items()]
    sc_list += [{"name": n, "status": "skipped", "request_ids": [],
                 "reason": "needs the host offload tier, not built yet"}
                for n in ("host-restore", "restart-restore")]
    packet = {
        "schema": PACKET_SCHEMA, "schema_version": SCHEMA_VERSION,
        "packet_id": "synthetic-0001",
        "created_by": {"tool": "flare.evidence.synthetic", "harness_version": "synthetic",
                       "command": ["synthetic"]},
        "provenance": {
            "flare_version": "0.1.0", "git_revision": None, "git_dirty": None,
            "package": {"package_id": PACKAGE_ID, "manifest_sha256": "b" * 64,
                        "model_name": "synthetic", "recipe": "llama"},
            "corpus": {"name": "synthetic-corpus", "sha256": "c" * 64, "sessions": 1},
            "machine": {"platform": "synthetic"},
            "server": {"url": "http://127.0.0.1:1", "started_by_harness": True,
                       "exclusive": True, "model": "synthetic", "system_fingerprint": PACKAGE_ID},
            "started_at": "2026-01-01T00:00:00+00:00", "ended_at": "2026-01-01T00:01:00+00:00",
        },
        "clocks": {
            "client": {"name": CLIENT, "source": "time.monotonic_ns() in the harness process",
                       "unit": "ns"},
            "server": {"name": SERVER, "source": "the server's flare response extension",
                       "unit": "ns", "available": True, "reason": None},
        },
        "settings": {"preset": "synthetic", "max_tokens": 8, "token_count_method": "tokenizer"},
        "capacity": {"label": capacity_label(PLAN), "claimed": dict(PLAN),
                     "claimed_from": "package", "plan": dict(PLAN), "memory_report": dict(MEMORY),
                     "kv_layout": dict(KV_LAYOUT), "server_max_model_len": PLAN["max_seq_len"]},
        "server_state": snaps,
        "scenarios": sc_list,
        "requests_sent": len(obs),
        "files": {},
        "seal": {},
    }
    return packet, obs


def write(folder: Path, packet: dict[str, Any], observations: list[dict[str, Any]],
          summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write and seal a packet; the summary is recomputed when not given."""
    if summary is None:
        summary = recompute.summarize(observations)
    return write_packet_files(folder, packet, observations, summary)


# --------------------------------------------------------------------------- defects


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
    packet["server_state"][-1]["state"].update(_state(obs, True))
    write(folder, packet, obs)


def _d_too_few_samples(folder, packet, obs):
    for rid in [o["request_id"] for o in obs if o["group"] == "ttft-512"][2:]:
        obs = _drop_request(packet, obs, rid)
    packet["requests_sent"] = len(obs)
    packet["server_state"][-1]["state"].update(_state(obs, True))
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
