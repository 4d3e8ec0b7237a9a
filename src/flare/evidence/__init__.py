"""Offline verifier of qualification packets (`flare evidence verify PACKET`).

A packet (written by `flare qualify`) is a folder: `packet.json`, `observations.jsonl`,
`summary.json`. The verifier only reads it, recomputes the chosen metric from the raw
observations, runs named checks and writes a receipt with a verdict: PASS, FAIL or
INCONCLUSIVE. See docs/evidence.md.

This package imports nothing from the server, the engine or the models: it must run where
only the packet exists (standard library, jsonschema).
"""

VERIFIER_NAME = "flare-evidence-verifier"
# Bump when a check, the metric definitions or the verdict rules change meaning.
# 1.1.0: summary schema 2 binds the observations' sha256; figures compared exactly.
VERIFIER_VERSION = "1.1.0"
