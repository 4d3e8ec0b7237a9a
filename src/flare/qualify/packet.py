"""Assemble and write a qualification packet (format: `flare.evidence.schema`)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import flare
from flare.evidence import recompute
from flare.evidence.checks import PLAN_KEYS, capacity_label
from flare.evidence.clocks import CLIENT, SERVER
from flare.evidence.schema import PACKET_SCHEMA, SCHEMA_VERSION, write_packet_files
from flare.qualify import HARNESS_VERSION


def capacity_block(package: dict[str, Any] | None, snapshots: list[dict[str, Any]],
                   server_max_model_len: int | None) -> dict[str, Any]:
    """The capacity the run claims: the package's plan when the package is known, else what
    the server reported (the fields it does not report stay null)."""
    if package is not None:
        claimed = {k: package["plan"].get(k) for k in PLAN_KEYS}
        source = "package"
    else:
        pages = next((s["state"]["pages_total"] for s in snapshots
                      if "pages_total" in s["state"]), None)
        claimed = {k: None for k in PLAN_KEYS}
        claimed.update(max_seq_len=server_max_model_len, num_pages=pages)
        source = "server"
    return {
        "label": capacity_label(claimed),
        "claimed": claimed,
        "claimed_from": source,
        "plan": package["plan"] if package else None,
        "memory_report": package["memory_report"] if package else None,
        "kv_layout": package["kv_layout"] if package else None,
        "server_max_model_len": server_max_model_len,
    }


def build_packet(*, observations: list[dict[str, Any]], scenarios: list[dict[str, Any]],
                 snapshots: list[dict[str, Any]], settings: dict[str, Any],
                 package: dict[str, Any] | None, corpus: dict[str, Any] | None,
                 server: dict[str, Any], server_max_model_len: int | None,
                 git: tuple[str | None, bool | None], machine: dict[str, Any],
                 started_at: str, ended_at: str, argv: list[str] | None = None) -> dict[str, Any]:
    """packet.json content before sealing."""
    with_server = sum(1 for o in observations if o["server"] is not None)
    reasons = sorted({o["server_unavailable"] for o in observations if o["server_unavailable"]})
    return {
        "schema": PACKET_SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "packet_id": uuid.uuid4().hex,
        "created_by": {"tool": "flare qualify", "harness_version": HARNESS_VERSION,
                       "command": list(argv if argv is not None else sys.argv)},
        "provenance": {
            "flare_version": flare.__version__,
            "git_revision": git[0],
            "git_dirty": git[1],
            "package": package["identity"] if package else None,
            "corpus": corpus,
            "machine": machine,
            "server": server,
            "started_at": started_at,
            "ended_at": ended_at,
        },
        "clocks": {
            "client": {"name": CLIENT, "unit": "ns",
                       "source": "time.monotonic_ns() in the harness process"},
            "server": {"name": SERVER, "unit": "ns",
                       "source": "the server's own monotonic clock, from the `flare` extension "
                                 "of the final stream chunk",
                       "available": with_server > 0,
                       "reason": None if with_server else
                       ("; ".join(reasons) or "no request reached the server")},
        },
        "settings": settings,
        "capacity": capacity_block(package, snapshots, server_max_model_len),
        "server_state": snapshots,
        "scenarios": scenarios,
        "requests_sent": sum(len(s["request_ids"]) for s in scenarios),
        "files": {},
        "seal": {},
    }


def write_packet(folder: Path, packet: dict[str, Any],
                 observations: list[dict[str, Any]]) -> dict[str, Any]:
    """Summarize and write the packet. The summary is computed first, so a packet whose
    observations mix clock domains is refused before anything is written. The summary binds
    the sha256 of the observations it was computed from (`summary.observations`, written by
    `recompute.summarize`), which the verifier recomputes.

    Raises:
        ClockDomainError: an observation's client or server block has the wrong clock label.
    """
    summary = recompute.summarize(observations)
    return write_packet_files(Path(folder), packet, observations, summary)
