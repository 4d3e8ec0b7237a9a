"""Property: corrupting a valid packet never yields PASS.

Three kinds of corruption:
- bytes: flip, delete, insert or truncate bytes of one evidence file, or delete the file
  (the packet is not resealed: an accident, a bad copy);
- resealed: edit the raw observations and reseal packet.json, keeping the summary the
  harness wrote (someone "fixing" the data afterwards): drop or duplicate an observation,
  move a token-carrying event in time (by as little as 1 ns), change how many tokens an
  event carried. The summary binds the sha256 of the observations it was computed from,
  so every such edit is caught, whether or not it changes a figure;
- rebound: the same edits, and the summary's binding recomputed as well, its figures kept.
  Every edit that changes a recomputed figure is caught (figures are compared exactly).
  An edit that changes no figure, with every digest recomputed, is a consistent rewrite:
  no offline check can see it (docs/evidence.md); only receipts or an out-of-band digest do.

Random, bounded: each test draws a moderate number of examples with no deadline.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from flare.evidence import recompute, synthetic, synthetic_defects  # noqa: E402
from flare.evidence.receipt import verify  # noqa: E402
from flare.evidence.schema import EVIDENCE_FILES  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def good_packet(tmp_path_factory) -> Path:
    folder = synthetic_defects.build(tmp_path_factory.mktemp("evidence-prop") / "good")
    assert verify(folder)["verdict"] == "PASS"
    return folder


def _copy(src: Path) -> Path:
    dst = Path(tempfile.mkdtemp(prefix="flare-prop-")) / "p"
    shutil.copytree(src, dst)
    return dst


@SETTINGS
@given(file=st.sampled_from(EVIDENCE_FILES),
       op=st.sampled_from(["flip", "delete", "insert", "truncate", "remove"]),
       where=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
       length=st.integers(min_value=1, max_value=64),
       byte=st.integers(min_value=0, max_value=255))
def test_byte_corruption_never_passes(good_packet, file, op, where, length, byte):
    folder = _copy(good_packet)
    try:
        path = folder / file
        data = bytearray(path.read_bytes())
        i = int(where * len(data))
        if op == "flip":
            new = (data[i] ^ (byte or 1)) & 0xFF
            data[i] = new
        elif op == "delete":
            del data[i:i + length]
        elif op == "insert":
            data[i:i] = bytes([byte]) * length
        elif op == "truncate":
            del data[i:]
        if op == "remove":
            path.unlink()
        else:
            path.write_bytes(bytes(data))
        assert verify(folder)["verdict"] != "PASS", (file, op, i)
    finally:
        shutil.rmtree(folder.parent, ignore_errors=True)


def _token_event_refs(obs: list[dict]) -> list[tuple[int, int]]:
    return [(i, j) for i, o in enumerate(obs) for j, e in enumerate(o["client"]["events"])
            if recompute.carries_tokens(e)]


EDITS = dict(
    op=st.sampled_from(["drop", "duplicate", "move", "retoken"]),
    pick=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
    # small moves (a nanosecond or a few) as often as large ones
    delta=st.one_of(st.integers(min_value=-3, max_value=3),
                    st.integers(min_value=-50_000_000, max_value=50_000_000)
                    ).filter(lambda d: d != 0),
    tokens=st.integers(min_value=0, max_value=5),
)


def _edit(obs: list[dict], op: str, pick: float, delta: int, tokens: int) -> None:
    """Apply one edit of the raw observations in place."""
    if op == "drop":
        del obs[int(pick * len(obs))]
    elif op == "duplicate":
        o = json.loads(json.dumps(obs[int(pick * len(obs))]))
        o["seq"] = len(obs)
        obs.append(o)
    else:
        refs = _token_event_refs(obs)
        i, j = refs[int(pick * len(refs))]
        event = obs[i]["client"]["events"][j]
        if op == "move":
            event["t_ns"] += delta
        else:
            if tokens == event["tokens"]:
                tokens = event["tokens"] + 1
            event["tokens"] = tokens


@SETTINGS
@given(**EDITS)
def test_resealed_edits_of_raw_observations_never_pass(tmp_path_factory, op, pick, delta,
                                                       tokens):
    packet, obs = synthetic.parts()
    summary = recompute.summarize(obs)  # the harness's claim, from the original data
    _edit(obs, op, pick, delta, tokens)
    folder = tmp_path_factory.mktemp("resealed") / "p"
    synthetic.write(folder, packet, obs, summary)
    receipt = verify(folder)
    assert receipt["verdict"] != "PASS", (op, pick, delta)


@SETTINGS
@given(**EDITS)
def test_rebound_edits_that_change_a_figure_never_pass(tmp_path_factory, op, pick, delta,
                                                       tokens):
    packet, obs = synthetic.parts()
    summary = recompute.summarize(obs)
    _edit(obs, op, pick, delta, tokens)
    recomputed = recompute.summarize(obs)
    summary["observations"] = recomputed["observations"]  # the binding, recomputed
    folder = tmp_path_factory.mktemp("rebound") / "p"
    synthetic.write(folder, packet, obs, summary)
    receipt = verify(folder)
    if recomputed["groups"] != summary["groups"]:
        assert receipt["verdict"] != "PASS", (op, pick, delta)
        assert "summary-agreement" in receipt["failing_checks"], (op, pick, delta)
