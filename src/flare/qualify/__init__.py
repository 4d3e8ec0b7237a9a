"""Qualification harness (`flare qualify`): run measured multi-turn workloads against a
server over HTTP/SSE and write a qualification packet (raw observations with client and
server clocks kept apart, provenance, capacity, summary). docs/qualification.md.

The packet format and the metric definitions live in `flare.evidence` (schema, recompute),
so the harness and the offline verifier read one definition.
"""

# Bump when what the harness sends or records changes meaning.
HARNESS_VERSION = "1.0.0"
