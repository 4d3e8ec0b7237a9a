"""Helpers of the HTTP tests, for any server with a `url` (ServerThread, ServerProcess):
an httpx client fixture, request bodies, error bodies, waits on /debug/state and
/metrics samples."""

from __future__ import annotations

import time

import httpx
import pytest


def http_client_fixture(name: str = "client", timeout: float = 120):
    """A module-scoped fixture `name`: an httpx.Client on the module's `server` fixture.
    In a test module: `client = http_client_fixture(timeout=60)`."""

    @pytest.fixture(scope="module", name=name)
    def _client(server):
        with httpx.Client(base_url=server.url, timeout=timeout) as c:
            yield c

    return _client


def user(content: str) -> list[dict]:
    """A conversation of one user message."""
    return [{"role": "user", "content": content}]


def error_of(r: httpx.Response, status: int, *, extra_fields_ok: bool = False) -> dict:
    """The OpenAI-shaped error of `r`, after checking its status: a message, and the fields
    message, type, param and code (and no other, unless `extra_fields_ok`)."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    fields = {"message", "type", "param", "code"}
    if extra_fields_ok:
        assert set(err) >= fields and err["message"]
    else:
        assert set(err) == fields and err["message"]
    return err


def wait_state(client: httpx.Client, pred, timeout: float = 10.0,
               failure: str = "/debug/state never satisfied the check") -> dict:
    """Poll /debug/state until `pred(state)`; fail with `failure` and the last state after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        state = client.get("/debug/state").json()
        if pred(state):
            return state
        assert time.monotonic() < deadline, f"{failure}: {state}"
        time.sleep(0.05)


def no_request_holds_pages(state: dict) -> bool:
    """Idle: nothing running or waiting, and the only pages in use are the prefix cache's."""
    return (state["num_running"] == 0 and state["num_waiting"] == 0
            and state["pages_used"] == state.get("prefix_cache_pages", 0))


def wait_idle(client: httpx.Client, timeout: float = 10.0) -> dict:
    """/debug/state once no request holds a page (only the prefix cache may)."""
    return wait_state(client, no_request_holds_pages, timeout, "engine not idle")


def metrics_lines(url: str) -> list[str]:
    """The lines of /metrics of the server at `url` (Prometheus text format)."""
    return httpx.get(url + "/metrics", timeout=10).text.splitlines()


def metric(url: str, name: str) -> float:
    """The value of the unlabelled sample `name` on /metrics of the server at `url`.

    Raises:
        AssertionError: no such sample.
    """
    for line in metrics_lines(url):
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")
