"""The request guard: API key on /v1 routes, body size limit, queue limit (issue 10)."""

from __future__ import annotations

import time

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from flare.server.guard import RequestGuard, keys_match

KEY = "sk-flare-test-0123456789"


def make_client(api_key=KEY, max_body=1024, protect_metrics=False, waiting=0, max_queue=4):
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
                       max_queue=max_queue)
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
