"""A real cluster on 127.0.0.1: redis-server, two `flare serve` replicas of the embedded
package with --remote-tier, SGLang's gateway `smg` (cache_aware, its HTTP worker mode: see
docs/scale-out.md for why not `--backend openai`) in front, and a --no-prefix-cache server
as the reference. Greedy, short answers; one cluster for the module. Skipped when
redis-server or smg is missing, except in CI (CI=true): a failure."""

from __future__ import annotations

import subprocess
import threading
import time

import httpx
import pytest
from http_helpers import metric, metrics_lines
from redis_process import RedisProcess, free_port, require
from server_process import ServerProcess

pytestmark = pytest.mark.slow

SYSTEM = {"role": "system", "content": "You are terse."}


@pytest.fixture(scope="module")
def cluster(smollm2_package, tmp_path_factory):
    smg = require("smg", "pip install smg (the test extra)")
    root = tmp_path_factory.mktemp("cluster")
    redis = RedisProcess(root / "redis")
    # A loaded CI machine must not decide these tests: a generous Redis timeout, and
    # restores admitted whatever their cost (the cost policy has its own tests).
    extra = ("--remote-tier", redis.url, "--remote-tier-timeout", "5",
             "--restore-cost-factor", "1000")
    procs: list = []
    try:
        a = ServerProcess(smollm2_package, root / "a.log", extra)
        procs.append(a)
        b = ServerProcess(smollm2_package, root / "b.log", extra)
        procs.append(b)
        cold = ServerProcess(smollm2_package, root / "cold.log", ("--no-prefix-cache",))
        procs.append(cold)
        port = free_port()
        log = open(root / "gateway.log", "wb")
        gw = subprocess.Popen(
            [smg, "launch", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
             "--policy", "cache_aware", "--worker-urls", a.url, b.url,
             "--health-check-interval-secs", "2", "--log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:  # both replicas discovered (their model) and healthy
            try:
                workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
                if sum(w["is_healthy"] and bool(w["models"]) for w in workers) == 2:
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            assert gw.poll() is None and time.monotonic() < deadline, \
                (root / "gateway.log").read_text()[-3000:]
            time.sleep(0.3)
        model = httpx.get(a.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        yield {"a": a, "b": b, "cold": cold, "gateway": url, "redis": redis, "model": model}
    finally:
        if "gw" in locals():
            gw.terminate()
            gw.wait(20)
            log.close()
        for p in procs:
            p.stop()
        redis.stop()


def chat(c: dict, url: str, messages: list[dict], max_tokens: int = 8, **extra) -> dict:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": c["model"], "messages": messages, "max_tokens": max_tokens,
        "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def respond(c: dict, url: str, text: str, previous: str | None = None) -> dict:
    body = {"model": c["model"], "input": text, "max_output_tokens": 6, "temperature": 0}
    if previous is not None:
        body["previous_response_id"] = previous
    r = httpx.post(url + "/v1/responses", timeout=120, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def text(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def reuse_metrics(url: str) -> str:
    """The replica's reuse outcomes and remote tier figures (why a restore did not happen)."""
    return "\n".join(line for line in metrics_lines(url)
                     if line.startswith(("flare_reuse_outcome", "flare_remote_tier")))


def remote_puts(url: str) -> float:
    """Records the replica at `url` has put in Redis: written, or found already stored."""
    return (metric(url, "flare_remote_tier_written_total")
            + metric(url, "flare_remote_tier_touched_total"))


def written_through(url: str, since: float, timeout: float = 60) -> None:
    """Wait until the replica at `url` has put a finished request's state in Redis: more
    puts than `since` (its `remote_puts` before the request) and nothing still queued.
    (No pending transfer alone is not enough: right after the response, the finish's
    write may not be queued yet, and records wait in the outbox behind a pending write.)"""
    deadline = time.monotonic() + timeout
    while not (remote_puts(url) > since and metric(url, "flare_transfer_pending") == 0
               and metric(url, "flare_tier_writes_waiting_records") == 0):
        assert time.monotonic() < deadline, f"{url} wrote nothing to Redis in {timeout} s"
        time.sleep(0.05)


def test_conversation_started_on_a_continues_on_b_restored_from_redis(cluster):
    c = cluster
    turn1 = [SYSTEM, {"role": "user", "content": "List four colours of the rainbow, "
                                                 "one per line, and nothing else."}]
    puts = remote_puts(c["a"].url)
    first = chat(c, c["a"].url, turn1)
    written_through(c["a"].url, puts)
    turn2 = turn1 + [{"role": "assistant", "content": text(first)},
                     {"role": "user", "content": "Now two more."}]
    got = chat(c, c["b"].url, turn2)
    assert cached(got) > 0, reuse_metrics(c["b"].url)
    assert text(got) == text(chat(c, c["cold"].url, turn2))
    assert metric(c["b"].url, "flare_remote_tier_read_hits_total") > 0


def test_gateway_session_of_ten_turns_reuses_every_turn_after_the_first(cluster):
    c = cluster
    messages = [SYSTEM, {"role": "user", "content": "Count with me, one word per turn."}]
    for turn in range(10):
        body = chat(c, c["gateway"], messages, max_tokens=6)
        if turn:
            assert cached(body) > 0, f"turn {turn} reused nothing"
        messages += [{"role": "assistant", "content": text(body)},
                     {"role": "user", "content": f"Next ({turn})."}]


def test_gateway_lists_the_model(cluster):
    c = cluster
    r = httpx.get(c["gateway"] + "/v1/models", timeout=10)
    assert r.status_code == 200, r.text
    assert [m["id"] for m in r.json()["data"]] == [c["model"]]


def test_gateway_polls_each_replicas_load(cluster):
    """smg reads each replica's GET /v1/loads for its load-aware policies: its own
    /get_loads lists both replicas with the KV capacity and sequence limit they report."""
    c = cluster
    want = {}
    for srv in (c["a"], c["b"]):
        load = httpx.get(srv.url + "/v1/loads", timeout=10).json()["loads"][0]
        want[srv.url] = (load["max_total_num_tokens"], load["max_running_requests"])
    deadline = time.monotonic() + 60
    while True:  # smg polls on its own interval
        got = {w["worker"].rstrip("/"): (w["max_total_num_tokens"], w["max_running_requests"])
               for w in httpx.get(c["gateway"] + "/get_loads", timeout=10).json()["loads"]}
        if got == want:
            break
        assert time.monotonic() < deadline, (got, want)
        time.sleep(1)
    assert all(tokens > 0 and seqs > 0 for tokens, seqs in want.values())


def test_previous_response_id_continues_on_the_other_replica(cluster):
    c = cluster
    puts_a, puts_b = remote_puts(c["a"].url), remote_puts(c["b"].url)
    first = respond(c, c["a"].url, "Name a colour of the sea.")
    written_through(c["a"].url, puts_a)
    second = respond(c, c["b"].url, "And of the sky?", first["id"])  # found through Redis
    assert second["flare"]["continuation"] == "exact"
    assert second["usage"]["input_tokens_details"]["cached_tokens"] > 0
    written_through(c["b"].url, puts_b)
    third = respond(c, c["a"].url, "And of grass?", second["id"])
    assert third["flare"]["continuation"] == "exact"
    assert third["usage"]["input_tokens_details"]["cached_tokens"] > 0
    assert httpx.delete(c["b"].url + f"/v1/responses/{third['id']}", timeout=10).json()[
        "deleted"]
    assert httpx.get(c["a"].url + f"/v1/responses/{third['id']}",  # a had its own copy
                     timeout=10).status_code == 404


def test_responses_and_sessions_through_the_gateway_reuse_every_turn(cluster):
    c = cluster
    previous = None
    for turn in range(4):
        body = respond(c, c["gateway"], f"Turn {turn}: one word, please.", previous)
        if turn:
            assert body["flare"]["continuation"] == "exact", turn
            assert body["usage"]["input_tokens_details"]["cached_tokens"] > 0, turn
        previous = body["id"]
    messages = [SYSTEM, {"role": "user", "content": "Spell a short word, letter by letter."}]
    for turn in range(4):
        body = chat(c, c["gateway"], messages, max_tokens=6, session="cluster-agent")
        if turn:
            assert cached(body) > 0, f"turn {turn} reused nothing"
        messages += [{"role": "assistant", "content": text(body)},
                     {"role": "user", "content": "Go on."}]
    for replica in ("a", "b"):  # the name is shared: either replica can report it
        got = httpx.get(c[replica].url + "/v1/sessions/cluster-agent", timeout=10)
        assert got.status_code == 200 and got.json()["tokens"] > 0, (replica, got.text)


def test_redis_killed_mid_workload_no_errors_answers_equal_recompute_and_back(cluster):
    c = cluster
    redis = c["redis"]
    redis.stop()
    try:
        for i in range(3):
            msgs = [SYSTEM, {"role": "user", "content": f"Say the number {i} in words."}]
            assert text(chat(c, c["a"].url, msgs)) == text(chat(c, c["cold"].url, msgs))
        health = httpx.get(c["a"].url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert metric(c["a"].url, "flare_remote_tier_up") == 0
    finally:
        redis.start()
    deadline = time.monotonic() + 20
    while httpx.get(c["a"].url + "/health", timeout=10).json()["status"] != "ok":
        assert time.monotonic() < deadline, "the remote tier did not come back"
        time.sleep(0.2)
    assert metric(c["a"].url, "flare_remote_tier_reconnects_total") >= 1


def test_bounded_load_through_the_gateway_has_no_errors(cluster):
    c = cluster
    errors: list[str] = []
    reused = []

    def client(k: int) -> None:
        msgs = [SYSTEM, {"role": "user", "content": f"Client {k}: name a fruit."}]
        with httpx.Client(timeout=120) as http:
            for turn in range(20):
                r = http.post(c["gateway"] + "/v1/chat/completions", json={
                    "model": c["model"], "messages": msgs, "max_tokens": 4,
                    "temperature": 0})
                if r.status_code != 200:
                    errors.append(f"{k}/{turn}: {r.status_code} {r.text[:200]}")
                    return
                body = r.json()
                if turn:
                    reused.append(cached(body) > 0)
                msgs += [{"role": "assistant", "content": text(body)},
                         {"role": "user", "content": "Another."}]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert len(reused) == 4 * 19 and sum(reused) / len(reused) > 0.9
