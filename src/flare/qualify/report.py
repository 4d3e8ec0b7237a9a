"""`flare qualify report DIR`: an HTML page with PNG plots, and a text table.

Every figure is recomputed from `observations.jsonl` with `flare.evidence.recompute` (the
definitions the verifier uses), not read from `summary.json`. Plots:
- `ttft_per_group.png`: client-clock TTFT of every request, per group, median marked;
- `agent_ttft_per_turn.png`: TTFT per agent turn, with reuse (`agent-session`) and without
  (`agent-session-cold`);
- `agent_cached_per_turn.png`: prompt tokens and cached (reused) prompt tokens per turn.

Tables: groups; restores (each measured `host-restore` / `restart-restore` request: the
server's reuse record, and the tier its state came from as the server's tier counters
changed between the snapshots `before:<request id>` and `after:<request id>`); agent turns.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from flare.evidence import recompute
from flare.evidence.schema import OBSERVATIONS_FILE, PACKET_FILE

AGENT, AGENT_COLD = "agent-session", "agent-session-cold"
RESTORE_GROUPS = ("host-restore", "restart-restore")
TIER_COUNTERS = {"host": "tier_restores_host_total", "disk": "tier_restores_disk_total"}


def _ms(ns: float | int | None) -> str:
    return "-" if ns is None else f"{ns / 1e6:.1f}"


def read_packet(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    folder = Path(folder)
    packet = json.loads((folder / PACKET_FILE).read_text(encoding="utf-8"))
    observations = [json.loads(line) for line in
                    (folder / OBSERVATIONS_FILE).read_text(encoding="utf-8").splitlines() if line]
    return packet, observations


def group_rows(observations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per group: counts, TTFT median/p90, ITL median, server TTFT, reuse."""
    rows = []
    for name in recompute.group_names(observations):
        g = recompute.group_summary([o for o in observations if o["group"] == name])
        outcomes = g["reuse"]["outcomes"]
        rows.append({
            "group": name,
            "n": g["requests"]["total"],
            "ok/failed/cancelled": f"{g['requests']['ok']}/{g['requests']['failed']}/"
                                   f"{g['requests']['cancelled']}",
            "ttft median ms": _ms(g["ttft_client_ns"]["median"]),
            "ttft p90 ms": _ms(g["ttft_client_ns"]["p90"]),
            "itl median ms": _ms(g["itl_client_ns"]["median"]),
            "server ttft median ms": _ms(g["ttft_server_ns"]["median"]),
            "prompt tok": g["usage"]["prompt_tokens"] if g["usage"]["n"] else "-",
            "cached tok": g["usage"]["cached_tokens"] if g["usage"]["n"] else "-",
            "reuse outcomes": (", ".join(f"{k}={v}" for k, v in outcomes.items() if v)
                               if outcomes else "not reported"),
        })
    return rows


def restore_rows(observations: list[dict[str, Any]],
                 snapshots: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per measured restore request: tokens, reuse record, the tier restored from (the
    change of the server's tier counters across the request, from the snapshots around
    it: "-" when either snapshot or counter is missing, "none" when no tier restored),
    client and server TTFT, server queue time."""
    by_label = {s["label"]: s["state"] for s in snapshots}
    rows = []
    for o in observations:
        if o["group"] not in RESTORE_GROUPS:
            continue
        before = by_label.get(f"before:{o['request_id']}")
        after = by_label.get(f"after:{o['request_id']}")
        tiers, restored = "-", "-"
        if before is not None and after is not None:
            got = {t: after[k] - before[k] for t, k in TIER_COUNTERS.items()
                   if k in before and k in after}
            if got:
                tiers = ", ".join(f"{t} x{n}" for t, n in got.items() if n) or "none"
            k = "tier_restored_tokens_total"
            if k in before and k in after:
                restored = after[k] - before[k]
        u, r = o["usage"] or {}, o["reuse"] or {}
        rows.append({
            "request": o["request_id"], "group": o["group"], "status": o["status"],
            "prompt tok": u.get("prompt_tokens", "-"), "cached tok": u.get("cached_tokens", "-"),
            "outcome": r.get("outcome", "not reported"),
            "matched tok": r.get("matched_tokens", "-"),
            "restored from": tiers, "tier restored tok": restored,
            "ttft ms": _ms(recompute.ttft_client_ns(o)),
            "server ttft ms": _ms(recompute.ttft_server_ns(o)),
            "server queue ms": _ms(recompute.queue_server_ns(o)),
        })
    return rows


def agent_turn_rows(observations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per agent turn: TTFT with reuse and without, prompt and cached tokens."""
    by_key: dict[tuple[str, int], dict[str, Any]] = {}
    for o in observations:
        if o["group"] not in (AGENT, AGENT_COLD):
            continue
        row = by_key.setdefault((o["session"], o["turn"]), {"session": o["session"],
                                                            "turn": o["turn"]})
        pre = "warm" if o["group"] == AGENT else "cold"
        row[f"{pre} ttft ms"] = _ms(recompute.ttft_client_ns(o))
        row[f"{pre} status"] = o["status"]
        if o["usage"]:
            row[f"{pre} prompt tok"] = o["usage"]["prompt_tokens"]
            row[f"{pre} cached tok"] = o["usage"]["cached_tokens"]
    order = {s: i for i, s in enumerate(dict.fromkeys(k[0] for k in by_key))}
    return [by_key[k] for k in sorted(by_key, key=lambda k: (order[k[0]], k[1]))]


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[str(r.get(c, "-")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def _html_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>(none)</p>"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '-')))}</td>" for c in cols)
                   + "</tr>" for r in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _plots(observations: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names: list[str] = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)

    def per_turn_axes(ax: Any, ylabel: str, title: str, legend: bool) -> None:
        ax.set_xlabel("turn")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if legend:
            ax.legend(fontsize=7)

    groups = recompute.group_names(observations)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(groups)), 4))
    for i, g in enumerate(groups):
        vals = [v / 1e6 for v in recompute.samples(
            [o for o in observations if o["group"] == g], "ttft_client_ns")]
        ax.scatter([i] * len(vals), vals, s=14, alpha=0.7)
        if vals:
            ax.hlines(recompute.median(vals), i - 0.3, i + 0.3, colors="black")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=30, ha="right")
    ax.set_ylabel("TTFT, client clock (ms)")
    ax.set_title("TTFT per group (dots: requests; bar: median)")
    save(fig, "ttft_per_group.png")

    agent = [o for o in observations if o["group"] in (AGENT, AGENT_COLD)]
    sessions = list(dict.fromkeys(o["session"] for o in agent))
    fig, ax = plt.subplots(figsize=(7, 4))
    for sid in sessions:
        for group, style in ((AGENT, "-o"), (AGENT_COLD, "--x")):
            pts = [(o["turn"], recompute.ttft_client_ns(o)) for o in agent
                   if o["session"] == sid and o["group"] == group]
            pts = [(t, v / 1e6) for t, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts), style, label=f"{sid} ({'reuse' if group == AGENT else 'cold'})")
    per_turn_axes(ax, "TTFT, client clock (ms)",
                  "Agent sessions: TTFT per turn, with reuse and cold", bool(sessions))
    save(fig, "agent_ttft_per_turn.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    for sid in sessions:
        obs = [o for o in agent if o["session"] == sid and o["group"] == AGENT and o["usage"]]
        if obs:
            turns = [o["turn"] for o in obs]
            ax.plot(turns, [o["usage"]["prompt_tokens"] for o in obs], "-o",
                    label=f"{sid}: prompt tokens")
            cached = [(o["turn"], o["usage"]["cached_tokens"]) for o in obs
                      if o["usage"]["cached_tokens"] is not None]
            if cached:
                ax.plot(*zip(*cached), "--s", label=f"{sid}: cached tokens")
    per_turn_axes(ax, "tokens", "Agent sessions: prompt and cached tokens per turn (usage)",
                  bool(sessions))
    save(fig, "agent_cached_per_turn.png")
    return names


def write_report(folder: Path, out: Path | None = None) -> tuple[Path, str]:
    """Write `out/index.html` (default `folder/report/`) and its PNGs.

    Returns:
        (path of index.html, the text table of groups and agent turns).
    """
    folder = Path(folder)
    packet, observations = read_packet(folder)
    out = Path(out) if out is not None else folder / "report"
    out.mkdir(parents=True, exist_ok=True)
    groups = group_rows(observations)
    turns = agent_turn_rows(observations)
    restores = restore_rows(observations, packet["server_state"])
    pngs = _plots(observations, out)
    prov = packet["provenance"]
    skipped = [s for s in packet["scenarios"] if s["status"] != "ran" or s["reason"]]
    info = {
        "packet_id": packet["packet_id"],
        "package_id": (prov["package"] or {}).get("package_id"),
        "model": prov["server"]["model"],
        "capacity": packet["capacity"]["label"],
        "flare": f"{prov['flare_version']} ({prov['git_revision'] or 'no git'}"
                 f"{', dirty' if prov['git_dirty'] else ''})",
        "corpus": f"{prov['corpus']['name']} {prov['corpus']['sha256'][:16]}"
                  if prov["corpus"] else None,
        "server clock": "available" if packet["clocks"]["server"]["available"] else
                        f"unavailable: {packet['clocks']['server']['reason']}",
        "preset": packet["settings"]["preset"],
        "run": f"{prov['started_at']} .. {prov['ended_at']}",
    }
    page = [
        "<!doctype html><html><head><meta charset='utf-8'><title>Flare qualification</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;"
        "font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
        "th{background:#f3f3f3}img{max-width:100%;margin:1em 0}</style></head><body>",
        "<h1>Flare qualification report</h1>",
        "<p>Figures recomputed from observations.jsonl (client clock unless labelled "
        "server). Verify the packet with <code>flare evidence verify</code>.</p>",
        _html_table([{"field": k, "value": v} for k, v in info.items()]),
        "<h2>Groups</h2>", _html_table(groups),
        "<h2>Scenarios not run, or with notes</h2>",
        _html_table([{"scenario": s["name"], "status": s["status"], "reason": s["reason"]}
                     for s in skipped]),
        "<h2>Restores (host-restore, restart-restore)</h2>",
        "<p>Tier: the server's tier counters' change across the request (snapshots "
        "<code>before:</code> / <code>after:</code> its id); TTFT on the client clock, "
        "server TTFT and queue time on the server clock.</p>", _html_table(restores),
        "<h2>Agent sessions per turn</h2>", _html_table(turns),
        *[f"<h2>{html.escape(p.removesuffix('.png').replace('_', ' '))}</h2>"
          f"<img src='{p}' alt='{p}'>" for p in pngs],
        "</body></html>",
    ]
    index = out / "index.html"
    index.write_text("\n".join(page) + "\n", encoding="utf-8")
    table = (format_table(groups) + "\n\nrestores (tier from the server's tier counters):\n"
             + format_table(restores) + "\n\nagent turns (warm = with reuse, cold = without):\n"
             + format_table(turns))
    return index, table
