"""The qualification harness without a model: SSE client on scripted streams, clock-domain
refusal, packet writing, the corpus, the report."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from flare.evidence import synthetic, synthetic_defects
from flare.evidence.checks import RESTARTED, check_counters, server_lifetimes
from flare.evidence.clocks import CLIENT, SERVER, ClockDomainError
from flare.evidence.receipt import verify
from flare.evidence.schema import PACKET_FILE, schema_errors
from flare.qualify.client import Client
from flare.qualify.packet import write_packet
from flare.qualify.report import restore_rows, write_report
from flare.qualify.runner import DEFAULT_CORPUS, load_corpus, prepare_out
from flare.qualify.scenarios import Run
from flare.qualify.server import ManagedServer
from flare.qualify.workload import Settings

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


class FakeServer:
    """A scripted server for `Run`: streams, /debug/state with counters that a restart
    resets, /v1/state/offload (or 503 without tiers), and a restart that can be counted."""

    def __init__(self, tiers: bool = True) -> None:
        self.tiers = tiers
        self.finished = 0
        self.offloads: list[str] = []
        self.restarts = 0
        self.paths: list[str] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.paths.append(f"{request.method} {path}")
        if path == "/debug/state":
            return httpx.Response(200, json={
                "num_running": 0, "num_waiting": 0, "pages_total": 8, "pages_used": 0,
                "pages_free": 8, "requests_finished_total": self.finished,
                "requests_aborted_total": 0, "tier_restores_host_total": len(self.offloads),
                "tier_restores_disk_total": 0})
        if path == "/v1/state/offload":
            if not self.tiers:
                return httpx.Response(503, json={"error": {
                    "message": "this server has no host tier", "type": "server_error",
                    "code": "no_host_tier"}})
            self.offloads.append(json.loads(request.content)["to"])
            return httpx.Response(200, json={"object": "state.offload", "to":
                                             self.offloads[-1], "pages_released": 3,
                                             "records_written": 0})
        self.finished += 1
        chunks = _sse(_chunk({"content": "a"}), _chunk({}, "stop"),
                      {"id": "x", "choices": [], "usage": USAGE, "flare": FLARE}, b"[DONE]")
        return httpx.Response(200, content=_stream(chunks))

    def restart(self) -> None:
        self.restarts += 1
        self.finished = 0  # a new process counts from 0


def _run(server: FakeServer, restart: bool = True, **settings) -> Run:
    client = Client("http://test", "m", transport=httpx.MockTransport(server.handler))
    run = Run(client, Settings.quick(ttft_samples=2, **settings), tokenizer=None, corpus=None,
              restart=server.restart if restart else None)
    run.run_all()
    return run


def test_run_lists_every_request_before_sending_it():
    server = FakeServer()
    run = _run(server)
    listed = [rid for s in run.scenarios for rid in s.request_ids]
    assert listed == [o["request_id"] for o in run.observations]
    names = [s.name for s in run.scenarios]
    rec = next(s for s in run.scenarios if s.name == "agent-session")
    assert rec.status == "skipped" and rec.reason and not rec.request_ids
    assert names[:6] == ["warmup", "ttft-512", "miss", "device-hit", "cancel", "branch"]
    assert names[-2:] == ["host-restore", "restart-restore"]  # the restart comes last
    assert all(s.status == "ran" for s in run.scenarios if s.name != "agent-session")
    assert run.snapshots[0]["label"] == "start" and run.snapshots[-1]["label"] == "end"


def test_host_and_restart_restore_offload_restart_and_resend():
    server = FakeServer()
    run = _run(server, host_restore=2, restart_restore=2, restore_turns=3)
    by_group: dict[str, list[dict]] = {}
    for o in run.observations:
        by_group.setdefault(o["group"], []).append(o)
    # host-restore: per conversation, turns 0 and 1 set up, then offload, then turn 2
    assert [(o["session"], o["turn"]) for o in by_group["host-restore.setup"]] == [
        ("host-0", 0), ("host-0", 1), ("host-1", 0), ("host-1", 1)]
    assert [(o["session"], o["turn"]) for o in by_group["host-restore"]] == [
        ("host-0", 2), ("host-1", 2)]
    # restart-restore: both conversations set up, one disk offload, one restart, a warmup
    # of the new process, then each conversation resent with its new turn
    setup = by_group["restart-restore.setup"]
    assert [(o["session"], o["turn"]) for o in setup] == [
        ("restart-0", 0), ("restart-0", 1), ("restart-1", 0), ("restart-1", 1), (None, None)]
    assert [(o["session"], o["turn"]) for o in by_group["restart-restore"]] == [
        ("restart-0", 2), ("restart-1", 2)]
    assert server.offloads == ["host", "host", "disk"] and server.restarts == 1
    # the measured request's prompt extends its setup turns: history + reply + new message
    first, last = by_group["host-restore.setup"][1], by_group["host-restore"][0]
    assert last["request"]["messages"] == first["request"]["messages"] + 2
    # the offload happens between the last setup turn and the measured turn
    order = [p for p in server.paths if p.startswith("POST")]
    i_host = order.index("POST /v1/state/offload")
    assert order[i_host - 1:i_host + 2] == ["POST /v1/chat/completions",
                                            "POST /v1/state/offload",
                                            "POST /v1/chat/completions"]
    labels = [s["label"] for s in run.snapshots]
    for o in by_group["host-restore"] + by_group["restart-restore"]:
        i = labels.index(f"before:{o['request_id']}")
        assert labels[i + 1] == f"after:{o['request_id']}"
    i = labels.index(f"{RESTARTED}restart-restore")
    assert labels[i - 1] == "offloaded:restart-restore"
    # client and server clocks stay apart in every restore observation
    for o in by_group["restart-restore"]:
        assert o["client"]["clock"] == CLIENT and o["server"]["clock"] == SERVER
        assert o["usage"]["cached_tokens"] == 32 and o["reuse"]["outcome"] == "Admitted"
    # the counters restart with the server: two lifetimes, each conserving its requests
    lives = server_lifetimes(run.snapshots)
    assert len(lives) == 2 and lives[1][0]["label"] == f"{RESTARTED}restart-restore"
    assert lives[1][0]["state"]["requests_finished_total"] == 0
    total = sum(life[-1]["state"]["requests_finished_total"]
                - life[0]["state"]["requests_finished_total"] for life in lives)
    assert total == len(run.observations)
    rows = restore_rows(run.observations, run.snapshots)
    assert [r["request"] for r in rows] == [o["request_id"] for o in
                                            by_group["host-restore"] + by_group["restart-restore"]]
    assert rows[0]["restored from"] == "none"  # the fake's counter moves at the offload
    assert rows[0]["outcome"] == "Admitted" and rows[0]["cached tok"] == 32


def test_restart_restore_is_skipped_without_a_restart_and_host_restore_needs_the_tier():
    server = FakeServer(tiers=False)
    run = _run(server, restart=False)
    sc = {s.name: s for s in run.scenarios}
    assert sc["restart-restore"].status == "skipped"
    assert "--url" in sc["restart-restore"].reason and not sc["restart-restore"].request_ids
    host = sc["host-restore"]
    assert host.status == "aborted" and "503 no_host_tier" in host.reason
    # what it sent before the refusal is still listed and observed
    assert host.request_ids == [o["request_id"] for o in run.observations
                                if o["scenario"] == "host-restore"]
    assert {o["group"] for o in run.observations if o["scenario"] == "host-restore"} == {
        "host-restore.setup"}
    assert server.restarts == 0
    run = _run(FakeServer(), restart_restore=0)
    assert {s.name: s for s in run.scenarios}["restart-restore"].reason == \
        "disabled (--no-restart)"


def test_managed_server_passes_its_state_folder(tmp_path: Path):
    srv = ManagedServer(tmp_path / "pkg", tmp_path / "log", state_dir=tmp_path / "state",
                        extra_args=("--max-queue", "4"))
    argv = srv.argv()
    assert argv[argv.index("serve") + 1] == str(tmp_path / "pkg")
    assert argv[argv.index("--state-dir") + 1] == str(tmp_path / "state")
    assert argv[argv.index("--port") + 1] == str(srv.port) and argv[-2:] == ["--max-queue", "4"]
    # --embedded: serve's own default state folder (CACHE_DIR/state) unless one is given
    emb = ManagedServer(None, tmp_path / "log").argv()
    assert "--embedded" in emb and "--state-dir" not in emb


def test_verifier_sums_counters_over_server_lifetimes(tmp_path: Path):
    """A restart resets the server's counters: each lifetime is conserved on its own, and a
    snapshot that claims a restart its counters do not show is a finding."""
    packet, obs = synthetic.parts()
    m = len(obs) // 2
    end = packet["server_state"][-1]
    start = packet["server_state"][0]
    mid_ns = obs[m]["client"]["send_ns"] - 1
    packet["server_state"] = [
        start,
        {"label": "offloaded:restart-restore", "client_ns": mid_ns - 1, "idle": True,
         "state": synthetic.state_counts(obs[:m], True)},
        {"label": f"{RESTARTED}restart-restore", "client_ns": mid_ns, "idle": True,
         "state": synthetic.state_counts(obs, False)},
        {**end, "state": synthetic.state_counts(obs[m:], True)},
    ]
    write_packet(tmp_path / "p", packet, obs)
    receipt = verify(tmp_path / "p")
    st = {c["name"]: c for c in receipt["checks"]}
    assert st["counter-conservation"]["status"] == "pass", st["counter-conservation"]
    assert "request counters across the run" in st["counter-conservation"]["message"]
    assert receipt["verdict"] == "PASS"

    class P:  # the loaded packet, as check_counters reads it
        pass

    p = P()
    p.packet, p.observations = packet, obs
    assert check_counters(p).status == "pass"
    # the same snapshots without the restart label: the counters went backwards
    packet["server_state"][2]["label"] = "after-restart"
    r = check_counters(p)
    assert r.status == "fail" and any("across the run" in f for f in r.findings)
    # a restart label on a server whose counters did not restart
    packet["server_state"][2]["label"] = f"{RESTARTED}restart-restore"
    packet["server_state"][2]["state"] = synthetic.state_counts(obs[:m], True)
    r = check_counters(p)
    assert r.status == "fail" and any("expected 0" in f for f in r.findings)


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
    synthetic_defects.build(tmp_path / "p")
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
    folder = synthetic_defects.build(tmp_path / "p")
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
    folder = synthetic_defects.build(tmp_path / "p")
    assert flare_main(["qualify", "report", str(folder)]) == 0
    assert "ttft-512" in capsys.readouterr().out
    assert (folder / "report" / "index.html").is_file()
