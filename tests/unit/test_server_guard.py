"""The request guard: API key on /v1 routes, body size limit, queue limit, message count,
request deadline, HTTP counters (issue 10)."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest

from flare.server.guard import (
    PromptBound,
    RequestGuard,
    ServerCounters,
    check_message_count,
    keys_match,
    with_deadline,
)
from flare.server.protocol import ApiError

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
