"""Property: corrupting a valid packet never yields PASS.

Two kinds of corruption:
- bytes: flip, delete, insert or truncate bytes of one evidence file, or delete the file
  (the packet is not resealed: an accident, a bad copy);
- content: edit one raw observation and reseal the packet, keeping the summary the harness
  wrote (someone "fixing" the data afterwards): drop or duplicate an observation, move a
  token-carrying event in time, change how many tokens an event carried.
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

from flare.evidence import recompute, synthetic  # noqa: E402
from flare.evidence.receipt import verify  # noqa: E402
from flare.evidence.schema import EVIDENCE_FILES  # noqa: E402

# derandomize: CI must be reproducible; a random run once found the gap noted in issue 7
SETTINGS = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def good_packet(tmp_path_factory) -> Path:
    folder = synthetic.build(tmp_path_factory.mktemp("evidence-prop") / "good")
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


@SETTINGS
@given(op=st.sampled_from(["drop", "duplicate", "move", "retoken"]),
       pick=st.floats(min_value=0.0, max_value=1.0, exclude_max=True),
       delta=st.integers(min_value=-50_000_000, max_value=50_000_000).filter(lambda d: d != 0),
       tokens=st.integers(min_value=0, max_value=5))
def test_resealed_edits_of_raw_observations_never_pass(tmp_path_factory, op, pick, delta, tokens):
    packet, obs = synthetic.parts()
    summary = recompute.summarize(obs)  # the harness's claim, from the original data
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
    folder = tmp_path_factory.mktemp("resealed") / "p"
    synthetic.write(folder, packet, obs, summary)
    assert verify(folder)["verdict"] != "PASS", (op, pick)
