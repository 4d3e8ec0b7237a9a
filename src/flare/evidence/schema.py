"""The packet format, version 1: file names, JSON Schemas, canonical JSON and the seal.

A packet is a folder with three evidence files:
- `packet.json`: provenance, settings, clocks, capacity, server-state snapshots, scenarios,
  the digests of the two other files (`files`) and a `seal` over its own content;
- `observations.jsonl`: one JSON object per line, one per request sent;
- `summary.json`: the harness's own figures (a claim the verifier recomputes), and the
  sha256 of the canonical observations they were computed from (`observations.sha256`,
  summary schema version 2), so a summary is bound to the raw data it describes.

`packet.json` and `summary.json` are written in canonical form (`canonical_json`), the
observations one compact sorted-key object per line; `seal.digest` is the SHA-256 of the
compact canonical JSON of `packet.json` without its `seal` key. Together with the file
digests this makes any change of any byte of the evidence visible; it is not a signature
(whoever can rewrite the files can reseal them, and recompute the summary's binding): the
receipt's sha256s are what bind a verdict to the bytes it was given.

JSON Schemas (draft 2020-12) live beside this module in `schemas/`.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

PACKET_SCHEMA = "flare-qualification-packet"
SCHEMA_VERSION = 1
SUMMARY_SCHEMA = "flare-qualification-summary"
# 2: the summary binds the sha256 of the canonical observations it was computed from
SUMMARY_SCHEMA_VERSION = 2
PACKET_FILE = "packet.json"
OBSERVATIONS_FILE = "observations.jsonl"
SUMMARY_FILE = "summary.json"
EVIDENCE_FILES = (PACKET_FILE, OBSERVATIONS_FILE, SUMMARY_FILE)
SEAL_ALGORITHM = "sha256-canonical-json"

SCHEMA_DIR = Path(__file__).parent / "schemas"
SCHEMA_FILES = {
    "packet": "packet.v1.schema.json",
    "observation": "observation.v1.schema.json",
    "summary": "summary.v2.schema.json",
    "receipt": "receipt.v1.schema.json",
}


def canonical_json(obj: Any) -> str:
    """The canonical text of a JSON file of the packet: sorted keys, 2-space indent,
    UTF-8 characters as they are, one trailing newline."""
    return json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def jsonl_line(obj: Any) -> str:
    """One line of observations.jsonl: compact, sorted keys, newline-terminated."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def observations_bytes(observations: list[dict[str, Any]]) -> bytes:
    """The canonical bytes of a list of observations: `jsonl_line` of each, in order (UTF-8).
    These are the bytes the packet writer puts in observations.jsonl."""
    return "".join(jsonl_line(o) for o in observations).encode("utf-8")


def observations_sha256(observations: list[dict[str, Any]]) -> str:
    """SHA-256 (hex) of `observations_bytes(observations)`: what a summary binds. It depends
    only on the parsed content, so it is recomputed from whatever observations.jsonl parses to
    (key order and spacing in the file do not matter; every value does)."""
    return sha256_bytes(observations_bytes(observations))


def seal_digest(packet: dict[str, Any]) -> str:
    """SHA-256 of the compact canonical JSON of `packet` without its `seal` key."""
    body = {k: v for k, v in packet.items() if k != "seal"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return sha256_bytes(text.encode("utf-8"))


def seal(packet: dict[str, Any], obs_bytes: bytes, summary_bytes: bytes) -> dict[str, Any]:
    """`packet` with `files` (digests, sizes, line count) and `seal` set for the given file
    contents. Returns a new dict."""
    out = dict(packet)
    out["files"] = {
        OBSERVATIONS_FILE: {"sha256": sha256_bytes(obs_bytes),
                            "bytes": len(obs_bytes),
                            "lines": obs_bytes.count(b"\n")},
        SUMMARY_FILE: {"sha256": sha256_bytes(summary_bytes), "bytes": len(summary_bytes)},
    }
    out["seal"] = {"algorithm": SEAL_ALGORITHM, "digest": "0" * 64}
    out["seal"] = {"algorithm": SEAL_ALGORITHM, "digest": seal_digest(out)}
    return out


def write_packet_files(folder: Path, packet: dict[str, Any], observations: list[dict[str, Any]],
                       summary: dict[str, Any]) -> dict[str, Any]:
    """Write the three evidence files of a packet into `folder` (created), sealed.

    Returns:
        The sealed packet.json content.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    obs_bytes = observations_bytes(observations)
    summary_bytes = canonical_json(summary).encode("utf-8")
    sealed = seal(packet, obs_bytes, summary_bytes)
    (folder / OBSERVATIONS_FILE).write_bytes(obs_bytes)
    (folder / SUMMARY_FILE).write_bytes(summary_bytes)
    (folder / PACKET_FILE).write_bytes(canonical_json(sealed).encode("utf-8"))
    return sealed


@lru_cache(maxsize=None)
def schema(kind: str) -> dict[str, Any]:
    """The JSON Schema of `kind` ("packet", "observation", "summary", "receipt")."""
    return json.loads((SCHEMA_DIR / SCHEMA_FILES[kind]).read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def validator(kind: str) -> Draft202012Validator:
    return Draft202012Validator(schema(kind))


def schema_errors(kind: str, instance: Any, limit: int = 5) -> list[str]:
    """Up to `limit` schema violations of `instance`, each as "path: message" (sorted by
    path, so the report is stable)."""
    errors = sorted(validator(kind).iter_errors(instance), key=lambda e: list(map(str, e.path)))
    out = []
    for e in errors[:limit]:
        where = "/".join(str(p) for p in e.path) or "(top)"
        out.append(f"{where}: {e.message}")
    return out
