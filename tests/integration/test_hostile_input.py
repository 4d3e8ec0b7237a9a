"""Hostile input and bursts over real HTTP (issue 23): the queue bound under a burst (case
api-queue-burst), unsatisfiable schemas on every surface (case api-unsatisfiable-schema),
chunked bodies over the limit, a grammar that fails mid-generation, lone surrogates, two
concurrent DELETEs of one session, the fork refusal at the session limit.

One real uvicorn server in a thread of the test process over the real engine and the
embedded model (tests/integration/server_thread.py), so the burst test samples the
engine's own `num_waiting` while the requests arrive, not /debug/state after the fact.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from http_helpers import error_of, http_client_fixture, user, wait_idle
from server_thread import embedded_server_fixture

pytestmark = pytest.mark.slow

MODEL = "smollm2-test"
MAX_QUEUE = 2
MAX_BODY = 1 << 20
BURST = 24
ROUNDS = 5

server = embedded_server_fixture(max_seq_len=256, model=MODEL, package_id="pkg-test",
                                max_queue=MAX_QUEUE, max_body_bytes=MAX_BODY)
client = http_client_fixture(timeout=120)

# the three schemas of issue 23
REQUIRED_SELF = {"$ref": "#/$defs/n", "$defs": {"n": {
    "type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}}}
ROOT_SELF = {"$ref": "#"}
MUTUAL = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                         "b": {"$ref": "#/$defs/a"}}}
SCHEMAS = {"required-self": REQUIRED_SELF, "root-self": ROOT_SELF, "mutual": MUTUAL}


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


# --------------------------------------------------------------------------- the burst


def _burst(server, client, body: dict, clients: int, rounds: int) -> tuple[list[int], list[int]]:
    """`rounds` bursts of `clients` simultaneous chat POSTs of `body` (each client connected
    before the burst, so they arrive together), a sampler thread reading the engine's
    num_waiting all along. Returns (every status, every num_waiting seen); a 429 must be
    queue_full with Retry-After."""
    engine = server.engine.engine
    seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(engine.num_waiting)
            time.sleep(0.0005)

    barrier = threading.Barrier(clients)
    conns = [httpx.Client(base_url=server.url, timeout=300) for _ in range(clients)]

    def one(i: int) -> int:
        conns[i].get("/health")
        barrier.wait(30)
        r = conns[i].post("/v1/chat/completions", json=body)
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "queue_full" and r.headers["retry-after"]
        return r.status_code

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    statuses: list[int] = []
    try:
        with ThreadPoolExecutor(clients) as pool:
            for _ in range(rounds):
                statuses += pool.map(one, range(clients))
                wait_idle(client, timeout=120)
    finally:
        stop.set()
        sampler.join(5)
        for c in conns:
            c.close()
    return statuses, seen


def test_max_queue_bounds_a_simultaneous_burst(server, client):
    """Case api-queue-burst: `--max-queue 2`, 24 clients at once, 5 rounds. A sampler
    thread reads the engine's num_waiting all along, and the engine's own high-water mark
    (taken under its inbox lock at every enqueue) confirms it: never above 2. The others
    get 429 queue_full at once."""
    wait_idle(client)
    body = {"model": MODEL, "messages": user("Count to one hundred."), "max_tokens": 40,
            "ignore_eos": True, "temperature": 0}
    statuses, seen = _burst(server, client, body, BURST, ROUNDS)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= ROUNDS * BURST // 2  # 4 running + 2 waiting at most
    assert len(seen) > 100 and max(seen) <= MAX_QUEUE, max(seen)
    assert server.engine.engine.stats()["num_waiting_peak"] <= MAX_QUEUE


def test_a_request_of_n_choices_holds_n_places_in_the_queue(server, client):
    """`n` choices are `n` waiting sequences: a burst of n=2 requests keeps num_waiting
    within --max-queue 2 (each admitted request widens its ticket to 2 before queueing, or
    gets 429 queue_full naming `n`), and n=3 alone could never be queued: 400 on `n`."""
    wait_idle(client)
    body = {"model": MODEL, "messages": user("Count to one hundred."), "max_tokens": 40,
            "ignore_eos": True, "temperature": 0, "n": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2, r.text
    err = error_of(client.post("/v1/chat/completions", json={**body, "n": 3}), 400)
    assert err["param"] == "n" and "--max-queue" in err["message"]
    statuses, seen = _burst(server, client, body, BURST, 3)  # the n=1 burst's pressure
    assert set(statuses) <= {200, 429} and 200 in statuses and 429 in statuses, statuses
    assert len(seen) > 100 and max(seen) <= MAX_QUEUE, max(seen)
    assert server.engine.engine.stats()["num_waiting_peak"] <= MAX_QUEUE


# --------------------------------------------------------------------------- schemas


@pytest.mark.parametrize("schema", SCHEMAS.values(), ids=SCHEMAS.keys())
def test_unsatisfiable_schemas_are_400_on_every_surface_before_admission(client, schema):
    """Case api-unsatisfiable-schema on chat response_format and tools (any tool_choice),
    Anthropic tools[].input_schema, Responses text.format and tools: 400
    unsupported_schema, and nothing reaches the engine."""
    before = client.get("/debug/state").json()["prompt_tokens_total"]
    tool = {"type": "function", "function": {"name": "walk", "parameters": schema}}
    chat = {"model": MODEL, "messages": user("hi"), "max_tokens": 4}
    cases = [
        ("/v1/chat/completions", {**chat, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}},
         "response_format"),
        ("/v1/chat/completions", {**chat, "tools": [tool], "tool_choice": "required"},
         "tools[0].function.parameters"),
        ("/v1/chat/completions", {**chat, "tools": [tool]}, "tools[0].function.parameters"),
        ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4, "text": {
            "format": {"type": "json_schema", "name": "x", "schema": schema}}},
         "text.format"),
        ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4,
                           "tools": [{"type": "function", "name": "walk",
                                      "parameters": schema}], "tool_choice": "required"},
         "tools[0].parameters"),
    ]
    for path, body, param in cases:
        err = error_of(client.post(path, json=body), 400)
        assert err["code"] == "unsupported_schema" and err["param"] == param, (path, err)
        assert "finite" in err["message"] or "no JSON value" in err["message"]
    r = client.post("/v1/messages", json={
        "model": MODEL, "max_tokens": 4, "messages": user("hi"),
        "tools": [{"name": "walk", "input_schema": schema}], "tool_choice": {"type": "any"}})
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and "'walk'" in r.json()["error"]["message"]
    assert client.get("/debug/state").json()["prompt_tokens_total"] == before


@pytest.fixture
def failing_grammar(monkeypatch):
    """Every grammar constraint gives up after its first token (as a resource limit of
    the constraint library would), on this test's requests."""
    from flare.server import grammar

    real_advance = grammar.GrammarConstraint.advance

    def failing_advance(self, token_id):
        real_advance(self, token_id)
        self._fail("injected by the test")

    monkeypatch.setattr(grammar.GrammarConstraint, "advance", failing_advance)


def test_a_grammar_failure_mid_generation_is_its_own_finish_reason_and_counted(
        client, failing_grammar):
    """A constraint that gives up (here: made to fail after its first token) never ends as
    `stop`: finish_reason "grammar_error", streamed and not, and counted on /metrics."""
    before = _metric(client, "flare_grammar_failures_total")
    body = {"model": MODEL, "messages": user("Give me a JSON object."), "max_tokens": 16,
            "temperature": 0, "response_format": {"type": "json_object"}}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "grammar_error"
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert reasons == ["grammar_error"]
    assert _metric(client, "flare_grammar_failures_total") == before + 2


def _sse_events(client: httpx.Client, path: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event of a streamed POST."""
    out, name = [], None
    with client.stream("POST", path, json={**body, "stream": True}) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: {"):
                out.append((name, json.loads(line[6:])))
    return out


def test_a_grammar_failure_fails_the_answer_on_the_anthropic_and_responses_surfaces(
        client, failing_grammar):
    """Surfaces without a finish reason for it never end a failed structure as `end_turn`
    or `completed`: Anthropic answers 400 (an `error` event when streamed, no
    message_stop); Responses ends `failed` with error code "grammar_error" (a
    `response.failed` event) and does not store it. Each failure is counted."""
    before = _metric(client, "flare_grammar_failures_total")
    schema = {"type": "object", "properties": {"path": {"type": "string"}},
              "required": ["path"]}
    messages = {"model": MODEL, "max_tokens": 16, "messages": user("Read a file."),
                "tools": [{"name": "read", "input_schema": schema}],
                "tool_choice": {"type": "any"}}
    r = client.post("/v1/messages", json=messages)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith("grammar_error:")
    assert "injected by the test" in err["error"]["message"]
    events = _sse_events(client, "/v1/messages", messages)
    names = [n for n, _ in events]
    assert names[-1] == "error" and "message_stop" not in names
    assert "message_delta" not in names
    assert events[-1][1]["error"]["message"].startswith("grammar_error:")

    responses = {"model": MODEL, "input": "Give me a JSON object.", "max_output_tokens": 16,
                 "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
    r = client.post("/v1/responses", json=responses)
    assert r.status_code == 200, r.text
    done = r.json()
    assert done["status"] == "failed" and done["error"]["code"] == "grammar_error"
    assert done["output"][0]["status"] == "incomplete"
    assert client.get(f"/v1/responses/{done['id']}").status_code == 404
    events = _sse_events(client, "/v1/responses", responses)
    assert events[-1][0] == "response.failed"
    assert events[-1][1]["response"]["error"]["code"] == "grammar_error"
    assert not any(n == "response.completed" for n, _ in events)
    assert _metric(client, "flare_grammar_failures_total") == before + 4


# --------------------------------------------------------------------------- bodies


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages",
                                  "/v1/responses", "/v1/messages/count_tokens"])
def test_a_chunked_body_over_the_limit_is_413(server, path):
    """Transfer-Encoding: chunked, no Content-Length, 2 MiB in 64 KiB chunks (issue 23):
    413, not the body parser's 400, and the server serves the next connection."""
    def chunks():
        for _ in range(32):
            yield b" " * (64 * 1024)

    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.post(path, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    if path.startswith("/v1/messages"):
        assert r.json()["error"]["type"] == "request_too_large"
    else:
        assert error_of(r, 413)["code"] == "request_too_large"


def test_a_lone_surrogate_is_a_400_in_the_requests_terms(client):
    raw = '{"model": "%s", "max_tokens": 2, %s}'
    for path, field, param in [
            ("/v1/chat/completions", '"messages": [{"role": "user", "content": "a\\ud800b"}]',
             "messages"),
            ("/v1/completions", '"prompt": "a\\udfffb"', "prompt")]:
        r = client.post(path, content=raw % (MODEL, field),
                        headers={"content-type": "application/json"})
        err = error_of(r, 400)
        assert err["param"] == param and "surrogate" in err["message"]
        assert "TextEncodeInput" not in err["message"] and "Union" not in err["message"]


# --------------------------------------------------------------------------- sessions


def test_two_concurrent_deletes_of_one_session_200_then_404(server, client):
    body = {"model": MODEL, "messages": user("hi"), "max_tokens": 2, "session": "twice"}
    for round_ in range(3):
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        barrier = threading.Barrier(2)

        def delete(_):
            barrier.wait(10)
            with httpx.Client(base_url=server.url, timeout=60) as c:
                return c.delete("/v1/sessions/twice")

        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(delete, range(2)))
        assert sorted(r.status_code for r in replies) == [200, 404], round_
        missing = next(r for r in replies if r.status_code == 404)
        assert error_of(missing, 404)["code"] == "session_not_found"


def test_fork_at_the_session_limit_is_too_many_sessions(client, monkeypatch):
    from flare.state import sessions

    body = {"model": MODEL, "messages": user("hi"), "max_tokens": 2, "session": "limit-a"}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    monkeypatch.setattr(sessions, "MAX_SESSIONS", 1)  # limit-a fills it
    err = error_of(client.post("/v1/sessions/limit-a/fork", json={"id": "limit-b"}), 400)
    assert err["code"] == "too_many_sessions"
    monkeypatch.undo()
    assert client.delete("/v1/sessions/limit-a").status_code == 200
