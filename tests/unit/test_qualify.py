"""The qualification harness without a model: SSE client on scripted streams, clock-domain
refusal, packet writing, the corpus, the report."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from flare.evidence import synthetic
from flare.evidence.clocks import CLIENT, SERVER, ClockDomainError
from flare.evidence.receipt import verify
from flare.evidence.schema import PACKET_FILE, schema_errors
from flare.qualify.client import Client
from flare.qualify.packet import write_packet
from flare.qualify.report import write_report
from flare.qualify.runner import DEFAULT_CORPUS, load_corpus, prepare_out
from flare.qualify.scenarios import Run, Settings

# --------------------------------------------------------------------------- SSE client


def _sse(*chunks) -> list[bytes]:
    out = []
    for c in chunks:
        out.append(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n")
    return out


def _chunk(delta=None, finish=None, **extra):
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "system_fingerprint": "pkg",
            "choices": [choice], "usage": None, **extra}


FLARE = [{"index": 0, "request_id": "chatcmpl-1-0", "clock": "server_monotonic_ns",
          "timings": {"arrival_ns": 100, "scheduled_ns": 110, "first_token_ns": 500,
                      "finished_ns": 900},
          "reuse": {"outcome": "Admitted", "matched_tokens": 32, "reused_tokens": 32}}]
USAGE = {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
         "prompt_tokens_details": {"cached_tokens": 32}}


def _stream(chunks: list[bytes], delay: float = 0.0):
    def gen():
        for c in chunks:
            if delay:
                time.sleep(delay)
            yield c
    return gen()


def _client(chunks, status=200, delay=0.002, count=len) -> tuple[Client, list]:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        if status != 200:
            return httpx.Response(status, json={"error": {
                "message": "prompt too long", "type": "invalid_request_error",
                "code": "context_length_exceeded"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=_stream(chunks, delay))

    return Client("http://test", "m", count_tokens=count,
                  transport=httpx.MockTransport(handler)), seen


def test_client_records_events_usage_server_clock_and_reuse():
    chunks = _sse(_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hel"}),
                  _chunk({"content": "lo!!"}), _chunk({}, "length"),
                  {"id": "chatcmpl-1", "choices": [], "usage": USAGE, "flare": FLARE}, b"[DONE]")
    client, seen = _client(chunks)
    obs, text = client.chat([{"role": "user", "content": "hi"}], 3)
    assert seen[0]["stream"] is True and seen[0]["stream_options"] == {"include_usage": True}
    assert text == "Hello!!"
    assert obs["status"] == "ok" and obs["finish_reason"] == "length"
    c = obs["client"]
    assert c["clock"] == CLIENT
    types = [e["type"] for e in c["events"]]
    assert types == ["role", "content", "content", "finish", "usage", "done"]
    assert [e["tokens"] for e in c["events"]] == [0, 3, 4, 0, 0, 0]  # count=len here
    times = [c["send_ns"], c["headers_ns"], *(e["t_ns"] for e in c["events"]), c["end_ns"]]
    assert times == sorted(times)
    assert obs["usage"] == {"prompt_tokens": 40, "completion_tokens": 3, "cached_tokens": 32}
    assert obs["server"] == {"clock": SERVER, "request_id": "chatcmpl-1-0",
                             "timings": FLARE[0]["timings"]}
    assert obs["reuse"] == FLARE[0]["reuse"]
    assert client.fingerprint == "pkg"


def test_client_accepts_the_choices_form_of_the_extension():
    chunks = _sse(_chunk({"content": "a"}), _chunk({}, "stop"),
                  {"id": "x", "choices": [], "usage": USAGE, "flare": {"choices": FLARE}},
                  b"[DONE]")
    obs, _ = _client(chunks)[0].chat([{"role": "user", "content": "hi"}], 3)
    assert obs["server"]["timings"]["first_token_ns"] == 500


def test_server_clock_is_recorded_unavailable_never_invented():
    chunks = _sse(_chunk({"content": "a"}), _chunk({}, "stop"),
                  {"id": "x", "choices": [], "usage": USAGE}, b"[DONE]")
    obs, _ = _client(chunks)[0].chat([{"role": "user", "content": "hi"}], 3)
    assert obs["server"] is None and obs["reuse"] is None
    assert "no flare extension" in obs["server_unavailable"]
    # a server that labels its timings with another clock is not taken at its word
    bad = [{**FLARE[0], "clock": "wall"}]
    chunks = _sse(_chunk({"content": "a"}), _chunk({}, "stop"),
                  {"id": "x", "choices": [], "usage": USAGE, "flare": bad}, b"[DONE]")
    obs, _ = _client(chunks)[0].chat([{"role": "user", "content": "hi"}], 3)
    assert obs["server"] is None and "'wall'" in obs["server_unavailable"]


def test_without_a_tokenizer_token_counts_are_unknown_not_zero():
    chunks = _sse(_chunk({"role": "assistant", "content": ""}), _chunk({"content": "a"}),
                  _chunk({}, "stop"), b"[DONE]")
    obs, _ = _client(chunks, count=None)[0].chat([{"role": "user", "content": "hi"}], 3)
    assert [e["tokens"] for e in obs["client"]["events"]] == [None, None, None, None]


def test_cancel_closes_the_stream_after_the_first_token():
    chunks = _sse(_chunk({"role": "assistant", "content": ""}), _chunk({"content": "one"}),
                  _chunk({"content": " two"}), _chunk({}, "stop"), b"[DONE]")
    obs, text = _client(chunks)[0].chat([{"role": "user", "content": "hi"}], 8,
                                        cancel_after_first_token=True)
    assert obs["status"] == "cancelled" and text == "one"
    assert [e["type"] for e in obs["client"]["events"]] == ["role", "content"]
    assert obs["usage"] is None and obs["server"] is None


def test_failures_are_observations():
    obs, _ = _client([], status=400)[0].chat([{"role": "user", "content": "hi"}], 3)
    assert obs["status"] == "failed"
    assert obs["error"]["http_status"] == 400
    assert obs["error"]["type"] == "context_length_exceeded"
    # a stream that stops without [DONE] is a failure, not a success
    chunks = _sse(_chunk({"content": "a"}))
    obs, _ = _client(chunks)[0].chat([{"role": "user", "content": "hi"}], 3)
    assert obs["status"] == "failed" and obs["error"]["type"] == "incomplete_stream"
    # an in-band error event
    chunks = _sse(_chunk({"content": "a"}), {"error": {"message": "boom", "type": "server_error"}},
                  b"[DONE]")
    obs, _ = _client(chunks)[0].chat([{"role": "user", "content": "hi"}], 3)
    assert obs["status"] == "failed" and obs["error"]["http_status"] == 200

    def refuse(request):
        raise httpx.ConnectError("refused")

    c = Client("http://test", "m", transport=httpx.MockTransport(refuse))
    obs, _ = c.chat([{"role": "user", "content": "hi"}], 3)
    assert obs["status"] == "failed" and obs["error"]["http_status"] is None


def test_run_lists_every_request_before_sending_it():
    chunks = _sse(_chunk({"content": "a"}), _chunk({}, "stop"), b"[DONE]")

    def handler(request):
        if request.url.path == "/debug/state":
            return httpx.Response(200, json={"num_running": 0, "num_waiting": 0,
                                             "pages_total": 8, "pages_used": 0, "pages_free": 8})
        return httpx.Response(200, content=_stream(list(chunks)))

    client = Client("http://test", "m", transport=httpx.MockTransport(handler))
    run = Run(client, Settings.quick(ttft_samples=2), tokenizer=None, corpus=None)
    run.run_all()
    listed = [rid for s in run.scenarios for rid in s.request_ids]
    assert listed == [o["request_id"] for o in run.observations]
    names = [s.name for s in run.scenarios]
    for skipped in ("agent-session", "host-restore", "restart-restore"):
        rec = next(s for s in run.scenarios if s.name == skipped)
        assert rec.status == "skipped" and rec.reason and not rec.request_ids
    assert names[:6] == ["warmup", "ttft-512", "miss", "device-hit", "cancel", "branch"]
    assert run.snapshots[0]["label"] == "start" and run.snapshots[-1]["label"] == "end"


# --------------------------------------------------------------------------- clock domains


def test_the_harness_refuses_to_summarize_mixed_clock_domains(tmp_path: Path):
    packet, obs = synthetic.parts()
    obs[3]["server"]["clock"] = CLIENT  # server times presented as client times
    with pytest.raises(ClockDomainError):
        write_packet(tmp_path / "p", packet, obs)
    assert not (tmp_path / "p").exists()
    packet, obs = synthetic.parts()
    obs[0]["client"]["clock"] = SERVER
    with pytest.raises(ClockDomainError):
        write_packet(tmp_path / "q", packet, obs)


def test_written_packet_validates_and_its_summary_agrees(tmp_path: Path):
    packet, obs = synthetic.parts()
    write_packet(tmp_path / "p", packet, obs)
    assert schema_errors("packet", json.loads((tmp_path / "p" / PACKET_FILE).read_text())) == []
    receipt = verify(tmp_path / "p")
    assert receipt["verdict"] == "PASS"


def test_prepare_out_refuses_to_mix_two_runs(tmp_path: Path):
    synthetic.build(tmp_path / "p")
    with pytest.raises(ValueError, match="already holds a packet"):
        prepare_out(tmp_path / "p", overwrite=False)
    prepare_out(tmp_path / "p", overwrite=True)
    assert not (tmp_path / "p" / PACKET_FILE).exists()


# --------------------------------------------------------------------------- corpus


def test_corpus_is_small_realistic_and_identified():
    corpus, ident = load_corpus(DEFAULT_CORPUS)
    assert DEFAULT_CORPUS.stat().st_size < 64 * 1024
    assert ident["name"] == "flare-agent-sessions-v1" and len(ident["sha256"]) == 64
    assert ident == load_corpus(DEFAULT_CORPUS)[1]  # stable
    assert len(corpus["sessions"]) >= 3
    tools = set()
    for s in corpus["sessions"]:
        turns = sum(1 for m in s["messages"] if m["role"] == "user")
        assert 10 <= turns <= 30, s["id"]
        assert turns == s["turns"]
        for m in s["messages"]:
            assert m["role"] in ("user", "assistant")
            if m["content"].startswith("<tool_call>"):
                tools.add(json.loads(m["content"][len("<tool_call>"):-len("</tool_call>")])["name"])
    assert {"shell", "read_file", "edit_file", "run_tests"} <= tools


# --------------------------------------------------------------------------- report


def test_report_renders_html_and_pngs(tmp_path: Path):
    folder = synthetic.build(tmp_path / "p")
    index, table = write_report(folder)
    assert index.is_file() and index.stat().st_size > 0
    html = index.read_text()
    for png in ("ttft_per_group.png", "agent_ttft_per_turn.png", "agent_cached_per_turn.png"):
        path = index.parent / png
        assert path.is_file() and path.stat().st_size > 1000
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png in html
    assert "ttft-512" in table and "agent turns" in table
    assert "host-restore" in html  # skipped scenarios are shown with their reason


# --------------------------------------------------------------------------- CLI


def test_qualify_cli_usage_and_report(tmp_path: Path, capsys):
    from flare.cli import main as flare_main
    from flare.qualify.server import free_port

    assert flare_main(["qualify"]) == 2
    assert flare_main(["qualify", "--out", str(tmp_path / "x")]) == 2
    assert flare_main(["qualify", "report"]) == 2
    assert flare_main(["qualify", "bogus", str(tmp_path)]) == 2
    capsys.readouterr()
    # nothing listens there: the run cannot happen (1), no packet is written
    url = f"http://127.0.0.1:{free_port()}"
    assert flare_main(["qualify", "--url", url, "--out", str(tmp_path / "none"),
                       "--no-cold"]) == 1
    assert not (tmp_path / "none" / PACKET_FILE).exists()
    assert "GET /v1/models failed" in capsys.readouterr().err
    folder = synthetic.build(tmp_path / "p")
    assert flare_main(["qualify", "report", str(folder)]) == 0
    assert "ttft-512" in capsys.readouterr().out
    assert (folder / "report" / "index.html").is_file()
