"""The request guard: API key on /v1 routes, body size limit, queue limit, message count,
request deadline, HTTP counters (issue 10)."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import BaseModel
from raw_sockets import read_until_closed

from flare.server.api_error import ApiError
from flare.server.guard import (
    PromptBound,
    RequestGuard,
    ServerCounters,
    check_message_count,
    keys_match,
    with_deadline,
)
from flare.server.queue_bound import Admission

KEY = "sk-flare-test-0123456789"


def make_client(api_key=KEY, max_body=1024, protect_metrics=False, waiting=0, max_queue=4,
                counters=None):
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return {"got": len(await request.body())}

    @app.get("/v1/models")
    async def models():
        return {"data": []}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return {"m": 1}

    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_body,
                       protect_metrics=protect_metrics, queue_length=lambda: waiting,
                       max_queue=max_queue, counters=counters)
    return TestClient(app)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("headers", [{}, auth("wrong"), auth(KEY[:-1]), {"Authorization": KEY},
                                     auth(KEY + "x")])
def test_every_v1_route_refuses_a_missing_or_wrong_key(headers):
    client = make_client()
    for r in (client.post("/v1/chat/completions", json={}, headers=headers),
              client.get("/v1/models", headers=headers)):
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_the_right_key_passes_and_health_stays_open():
    client = make_client()
    assert client.post("/v1/chat/completions", json={}, headers=auth(KEY)).status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert make_client(protect_metrics=True).get("/metrics").status_code == 401


def test_no_key_configured_means_an_open_server():
    assert make_client(api_key=None).get("/v1/models").status_code == 200


def test_oversized_bodies_get_413_by_length_and_while_streaming():
    client = make_client(api_key=None, max_body=1000)
    r = client.post("/v1/chat/completions", content=b"x" * 1001)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it is read
        for _ in range(5):
            yield b"y" * 300

    r = client.post("/v1/chat/completions", content=chunks())
    assert r.status_code == 413
    assert client.post("/v1/chat/completions", content=b"z" * 1000).json() == {"got": 1000}


def test_a_full_queue_gets_429_with_retry_after():
    r = make_client(api_key=None, waiting=4, max_queue=4).post("/v1/chat/completions", json={})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"


def test_key_compare_time_does_not_depend_on_a_shared_prefix():
    """Constant-time helper: a wrong key sharing a long prefix takes no longer to refuse."""
    expected = "k" * 4096
    near, far = "k" * 4095 + "x", "x" + "k" * 4095
    assert not keys_match(near, expected) and not keys_match(far, expected)

    def best_of(given: str) -> float:
        times = []
        for _ in range(7):
            t = time.perf_counter_ns()
            for _ in range(2000):
                keys_match(given, expected)
            times.append(time.perf_counter_ns() - t)
        return min(times)

    # a short-circuiting compare would make `far` ~4000x faster than `near`
    assert best_of(far) > 0.3 * best_of(near)


def test_an_unexpected_error_is_a_500_body_and_the_connection_stays_usable():
    app = FastAPI()

    @app.get("/v1/boom")
    async def boom():
        raise RuntimeError("bug")

    @app.get("/v1/fine")
    async def fine():
        return {"ok": True}

    app.add_middleware(RequestGuard, api_key=None, max_body_bytes=1024, protect_metrics=False,
                       queue_length=lambda: 0, max_queue=4)
    client = TestClient(app, raise_server_exceptions=False)
    r = client.get("/v1/boom")
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert client.get("/v1/fine").json() == {"ok": True}


def test_counters_count_responses_by_status_refusals_included():
    counters = ServerCounters()
    client = make_client(max_body=10, counters=counters)
    client.get("/v1/models")  # 401
    client.post("/v1/chat/completions", content=b"x" * 11, headers=auth(KEY))  # 413
    client.get("/health")  # 200
    client.get("/health")
    counters.count_timeout()
    assert dict(counters.responses) == {401: 1, 413: 1, 200: 2}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(counters)
    text = generate_latest(registry).decode()
    assert 'flare_http_responses_total{code="200"} 2.0' in text
    assert 'flare_http_responses_total{code="413"} 1.0' in text
    assert "flare_request_timeouts_total 1.0" in text


def test_message_count_over_the_limit_is_a_400_naming_both():
    check_message_count(8, 8)
    with pytest.raises(ApiError) as e:
        check_message_count(9, 8)
    err = e.value
    assert err.status_code == 400 and err.param == "messages"
    assert err.code == "array_above_max_length"
    assert "9" in err.message and "8" in err.message


class _Ticker:
    """An async stream of ints, one per `period` seconds; records that it was closed."""

    def __init__(self, count: int, period: float) -> None:
        self.count, self.period = count, period
        self.closed = False

    async def run(self):
        try:
            for i in range(self.count):
                await asyncio.sleep(self.period)
                yield i
        finally:
            self.closed = True


def test_deadline_passes_a_stream_that_ends_in_time():
    ticker = _Ticker(3, 0.001)

    async def main():
        deadline = time.monotonic() + 30
        return [i async for i in with_deadline(ticker.run(), deadline, 30)]

    assert asyncio.run(main()) == [0, 1, 2]
    assert ticker.closed


def test_deadline_stops_a_slow_stream_with_a_504_and_closes_it():
    """The pending step is cancelled at the deadline (not after the next item), the
    stream is closed (that is what aborts its engine requests), the timeout counted."""
    ticker = _Ticker(1000, 0.05)
    counters = ServerCounters()
    got = []

    async def main():
        t0 = time.monotonic()
        with pytest.raises(ApiError) as e:
            async for i in with_deadline(ticker.run(), t0 + 0.3, 0.3, counters):
                got.append(i)
        return e.value, time.monotonic() - t0

    err, elapsed = asyncio.run(main())
    assert err.status_code == 504 and err.code == "request_timeout"
    assert err.type == "server_error" and "0.3 s" in err.message
    assert ticker.closed and counters.request_timeouts == 1
    assert 1 <= len(got) < 1000 and elapsed < 5


def test_deadline_already_passed_starts_nothing():
    ticker = _Ticker(5, 0.001)

    async def main():
        with pytest.raises(ApiError):
            async for _ in with_deadline(ticker.run(), time.monotonic() - 1, 2.5):
                pass

    asyncio.run(main())
    assert not ticker.closed  # never started; closing an unstarted generator runs nothing


# --------------------------------------------------------------------------- prompt bound


@pytest.mark.parametrize("text", [
    "#" * 5000,  # the vocabulary's longest strings are runs of '#' and of spaces
    "\n" + " " * 8000,
    "word " * 3000,
    "naïve café ﬁ ｶﾞ 한국어 \u1100\u1161\u11a8 " * 200,  # composed/compatibility forms
    "".join(chr(c) for c in range(0x20, 0x3000, 7)),
])
def test_prompt_bound_never_exceeds_the_real_token_count(embedded_checkpoint, text):
    tok = embedded_checkpoint.tokenizer
    bound = PromptBound(tok, max_seq_len=1)
    real = len(tok.encode(text, add_special_tokens=False))
    assert len(text) // (bound.longest * bound.SLACK) <= real
    limited = PromptBound(tok, max_seq_len=real)  # the text fits exactly: never refused
    limited.check(len(text), "prompt")


def test_prompt_bound_refuses_text_longer_than_any_fitting_prompt(embedded_checkpoint):
    bound = PromptBound(embedded_checkpoint.tokenizer, max_seq_len=8)
    bound.check(bound.max_chars, "prompt")
    with pytest.raises(ApiError) as e:
        bound.check(bound.max_chars + 1, "messages")
    assert e.value.status_code == 400 and e.value.param == "messages"
    assert "maximum context length is 8 tokens" in str(e.value)


# --------------------------------------------------------------------------- issue 23


class _Body(BaseModel):
    model: str = "m"
    prompt: str = ""


def test_a_chunked_body_over_the_limit_is_413_through_a_parsing_route():
    """FastAPI's body parser turns any exception while reading into 400 "There was an error
    parsing the body"; the guard answers 413 itself the moment the limit is passed."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(body: _Body):
        return {"ok": True}

    app.add_middleware(RequestGuard, api_key=None, max_body_bytes=64 * 1024,
                       protect_metrics=False, queue_length=lambda: 0, max_queue=4)
    client = TestClient(app)

    def chunks():  # no Content-Length: 2 MiB in 64 KiB chunks, as in the issue
        for _ in range(32):
            yield b" " * (64 * 1024)

    r = client.post("/v1/chat/completions", content=chunks(),
                    headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    assert client.post("/v1/chat/completions", json={"prompt": "x"}).json() == {"ok": True}


def test_admission_holds_the_bound_for_simultaneous_arrivals():
    """24 requests arrive in one instant with max_queue 2: exactly 2 get a ticket while
    nothing is queued yet; a ticket released at enqueue keeps the bound with the queue."""
    waiting = [0]
    admission = Admission(lambda: waiting[0], 2)
    tickets = [admission.take() for _ in range(24)]
    assert sum(t is not None for t in tickets) == 2
    first = tickets[0]
    waiting[0] += 1  # the engine counts it in num_waiting, then the ticket is released
    first()
    first()  # idempotent
    assert admission.pending == 1
    assert admission.take() is None  # 1 queued + 1 pending: the bound holds
    waiting[0] = 0  # both started running
    tickets[1]()
    assert admission.pending == 0
    assert admission.take() is not None and admission.take() is not None
    assert admission.take() is None


def test_a_ticket_widens_to_n_sequences_and_gives_them_back_one_by_one():
    """A request of n choices holds n places; each enqueued sequence returns one; the
    ticket's release returns what is left; widening past the bound holds what it held."""
    waiting = [0]
    admission = Admission(lambda: waiting[0], 3)
    ticket = admission.take()
    assert ticket.widen(3) and admission.pending == 3
    assert admission.take() is None
    for _ in range(2):  # two sequences counted in the engine's queue
        waiting[0] += 1
        ticket.enqueued()
    assert admission.pending == 1 and admission.take() is None
    ticket()
    ticket()
    assert admission.pending == 0
    other = admission.take()  # 2 waiting + 1 pending: full
    assert other is not None and not other.widen(2) and admission.pending == 1
    other()
    assert admission.pending == 0


@pytest.fixture(scope="module")
def slow_server():
    """A real uvicorn server (Flare's connection protocol and guard) on 127.0.0.1 with
    a 1 s header timeout and a 1 s body timeout."""
    import uvicorn

    from flare.server.connection import uvicorn_config

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: _Body):
        return {"prompt": body.prompt}

    app.add_middleware(RequestGuard, api_key=None, max_body_bytes=1 << 20,
                       protect_metrics=False, queue_length=lambda: 0, max_queue=64,
                       body_timeout_s=1.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, host="127.0.0.1", port=port,
                                           log_level="warning", header_timeout_s=1.0))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(10)


def test_slow_bodies_and_slow_headers_are_cut_by_their_timeouts(slow_server):
    """Three connections each: a Content-Length larger than the bytes sent, a body
    trickled a byte at a time, headers never finished. Each gets 408 and is closed
    within a few seconds; a well-behaved request on a fresh connection is served."""
    body = b'{"prompt": "hello"}'
    short = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
             b"content-length: 1000\r\n\r\n" + body)
    socks = []
    for _ in range(3):
        for opening in (short, short[:-len(body)], b"POST /v1/completions HTTP/1.1\r\nhost"):
            s = socket.create_connection(("127.0.0.1", slow_server))
            s.sendall(opening)
            socks.append((s, opening))
    trickled = [s for s, o in socks if o == short[:-len(body)]]
    for _ in range(6):  # a byte every 0.25 s: alive, never done, until the server answers
        time.sleep(0.25)
        for s in list(trickled):
            answered, _, _ = select.select([s], [], [], 0)
            try:
                if not answered:
                    s.sendall(b" ")
                    continue
            except (BrokenPipeError, ConnectionResetError):
                pass  # the 408 and the close raced our byte; the read below checks it
            trickled.remove(s)
    for s, opening in socks:
        data, took = read_until_closed(s, 10)
        s.close()
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        code = "header_timeout" if opening.endswith(b"host") else "body_timeout"
        assert code.encode() in data
        assert took < 8  # closed by the server, not by our 10 s read limit
    with socket.create_connection(("127.0.0.1", slow_server)) as s:
        s.sendall(short.replace(b"1000", str(len(body)).encode()))
        s.settimeout(10)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")


def test_an_idle_connection_is_closed_without_an_answer(slow_server):
    """No byte of a request within the header timeout, on a new connection or after a
    response on a kept-alive one: closed, with no 408 a pooled client could read as the
    answer to its next request."""
    body = b'{"prompt": "hi"}'
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
               b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    with socket.create_connection(("127.0.0.1", slow_server)) as s:
        data, took = read_until_closed(s, 10)
    assert data == b"" and took < 8
    with socket.create_connection(("127.0.0.1", slow_server)) as s:
        s.settimeout(10)
        s.sendall(request)
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        data, took = read_until_closed(s, 10)
    assert b"408" not in data and took < 8


def test_a_kept_alive_connection_gets_a_fresh_header_timeout(slow_server):
    """After a response, the next request's headers have the timeout again."""
    body = b'{"prompt": "hi"}'
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
               b"\r\ncontent-length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    with socket.create_connection(("127.0.0.1", slow_server)) as s:
        s.settimeout(10)
        s.sendall(request)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nho")  # and never more
        data, took = read_until_closed(s, 10)
    assert b"408" in data.split(b"\r\n", 1)[0] and took < 8
