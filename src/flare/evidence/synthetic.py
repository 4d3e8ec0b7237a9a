"""Synthetic packets: one small valid packet (`flare.evidence.synthetic_defects` spoils it).

For the verifier's tests and docs. `parts()` makes a packet that verifies PASS and `write`
seals it; `flare.evidence.synthetic_defects` writes it with one defect. Numbers are made up
but consistent (capacity of a 30-layer, 3-KV-head model; counters that add up); nothing
here talks to a server.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from flare.evidence import recompute
from flare.evidence.checks import capacity_label
from flare.evidence.clocks import CLIENT, SERVER
from flare.evidence.schema import (
    PACKET_SCHEMA,
    SCHEMA_VERSION,
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


def state_counts(obs: list[dict[str, Any]], final: bool) -> dict[str, int]:
    """The counters of a /debug/state snapshot consistent with `obs` (all zero at the
    start, `final` False)."""
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
    snaps = [{"label": "start", "client_ns": start_ns, "idle": True, "state": state_counts(obs, False)},
             {"label": "end", "client_ns": end_ns, "idle": True, "state": state_counts(obs, True)}]
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
