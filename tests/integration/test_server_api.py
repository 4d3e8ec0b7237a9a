"""The HTTP API end to end: a real uvicorn server over the real engine and the embedded model.

Cases from cases/api.md: api-utf8-split, api-stop-across-tokens, api-usage-chunk,
api-max-tokens-edge, api-disconnect, api-seed, api-system-and-empty, api-n-stream,
api-late-system-message, api-context-overflow. Engine failures are driven through a scripted
fake engine (last section), since the real one does not fail on demand.

The server runs in a thread with its own event loop (the engine's AsyncEngine must be made
inside it); tests talk to it over real sockets, so client disconnects are real.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from http_helpers import http_client_fixture, wait_idle
from scripted_engine import ScriptedEngine
from server_thread import embedded_server_fixture

pytestmark = pytest.mark.slow

MAX_SEQ_LEN = 256
MODEL = "smollm2-test"


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def checkpoint(embedded_checkpoint):
    return embedded_checkpoint  # tests/conftest.py: the embedded GGUF, read once per session


server = embedded_server_fixture(max_seq_len=MAX_SEQ_LEN, model=MODEL, package_id="pkg-test",
                                max_n=4)

client = http_client_fixture(timeout=120)


def _chat(client, content="Say hello.", **kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}
    return client.post("/v1/chat/completions", json=body)


def _events(response) -> list:
    """Parsed SSE events of a finished response; "[DONE]" kept as a string."""
    events = []
    for block in response.text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _stream_chat(client, content="Say hello.", **kw):
    r = _chat(client, content, stream=True, **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def _stream_texts(events, n=1):
    texts, finish = [""] * n, [None] * n
    for ev in events:
        for ch in ev["choices"]:
            assert finish[ch["index"]] is None, "content after finish_reason"
            texts[ch["index"]] += ch["delta"].get("content") or ""
            if ch["finish_reason"] is not None:
                finish[ch["index"]] = ch["finish_reason"]
    return texts, finish


# --------------------------------------------------------------------------- basics


def test_models_health_metrics(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_SEQ_LEN
    assert client.get("/health").json() == {"status": "ok"}
    text = client.get("/metrics").text
    for name in ("flare_pages_used", "flare_pages_free", "flare_pages_total",
                 "flare_num_running", "flare_num_waiting", "flare_prompt_tokens_total",
                 "flare_generation_tokens_total", "flare_requests_finished_total"):
        assert f"\n{name} " in text, name
    state = client.get("/debug/state").json()
    assert state["pages_total"] == state["pages_free"] + state["pages_used"]


def test_loads_report_the_engine_in_the_shape_a_gateway_polls(client, server):
    """GET /v1/loads (smg's WorkerLoadResponse): one rank whose KV tokens and requests are
    the engine's own counters, and whose cache hit rate is the prefix cache's share."""
    wait_idle(client)
    _chat(client, content="Name three rivers.", max_tokens=4)
    _chat(client, content="Name three rivers.", max_tokens=4)  # the same prompt: a reuse
    wait_idle(client)
    r = client.get("/v1/loads", params={"include": "core,disagg,queues,memory"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["dp_rank_count"] == 1 and len(body["loads"]) == 1 and body["timestamp"]
    load, state = body["loads"][0], client.get("/debug/state").json()
    page = server.engine.plan.page_size
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    assert load["max_total_num_tokens"] == state["pages_total"] * page
    assert load["num_used_tokens"] == state["pages_used"] * page
    assert load["token_usage"] == load["num_used_tokens"] / load["max_total_num_tokens"]
    assert load["cache_hit_rate"] == (state["prefix_cache_hits_total"]
                                      / state["prefix_cache_queries_total"]) > 0
    assert load["max_running_requests"] == server.engine.plan.max_num_seqs


def test_chat_completion_shape(client):
    r = _chat(client, temperature=0, max_tokens=8)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 1 <= u["completion_tokens"] <= 8
    assert u["prompt_tokens_details"]["cached_tokens"] >= 0


def test_openai_sdk(server):
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    out = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                      temperature=0, max_tokens=6)
    stream = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                         temperature=0, max_tokens=6, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == (
        out.choices[0].message.content)
    comp = sdk.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "Hi"}])


# --------------------------------------------------------------------------- cases


def test_utf8_split_stream_equals_non_stream(client):
    """api-utf8-split"""
    kw = {"temperature": 0, "max_tokens": 40}
    content = "Reply with exactly: 推理 🧪 café"
    whole = _chat(client, content, **kw).json()["choices"][0]["message"]["content"]
    events = _stream_chat(client, content, **kw)
    assert not any("\ufffd" in json.dumps(ev, ensure_ascii=False) for ev in events)
    (text,), _ = _stream_texts(events)
    assert text.encode() == whole.encode()
    assert "\ufffd" not in whole


def test_stop_across_tokens(client, checkpoint):
    """api-stop-across-tokens: a stop string spanning two generated tokens."""
    tok = checkpoint.tokenizer
    kw = {"temperature": 0, "max_tokens": 40}
    prompt = "Count from 1 to 20, separated by commas."
    text = _chat(client, prompt, **kw).json()["choices"][0]["message"]["content"]
    ids = tok.encode(text, add_special_tokens=False)
    # Find a token boundary inside the text where last char + next 2 chars first occur there.
    stop = None
    pos = 0
    for a, b in zip(ids, ids[1:]):
        pos += len(tok.decode([a]))
        cand = text[pos - 1: pos + 2]
        if pos > 4 and len(cand) == 3 and text.find(cand) == pos - 1:
            stop = cand
            break
    assert stop is not None, f"no usable token boundary in {text!r}"
    expected = text[: text.find(stop)]
    body = _chat(client, prompt, stop=[stop], **kw).json()
    assert body["choices"][0]["message"]["content"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    events = _stream_chat(client, prompt, stop=stop, **kw)
    (streamed,), (finish,) = _stream_texts(events)
    assert (streamed, finish) == (expected, "stop")


def test_usage_chunk(client):
    """api-usage-chunk"""
    kw = {"temperature": 0, "max_tokens": 10}
    usage = _chat(client, **kw).json()["usage"]
    events = _stream_chat(client, stream_options={"include_usage": True}, **kw)
    *content, last = events
    assert all("usage" in ev and ev["usage"] is None for ev in content)
    assert last["choices"] == [] and last["usage"] == usage
    plain = _stream_chat(client, **kw)
    assert all(ev.get("usage") is None and ev["choices"] for ev in plain)


def test_max_tokens_one_and_clamp_at_limit(client, checkpoint):
    """api-max-tokens-edge: policy = clamp, ending with "length" at max_seq_len."""
    body = _chat(client, temperature=0, max_tokens=1).json()
    assert body["usage"]["completion_tokens"] == 1
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    prompt = list(range(1000, 1000 + MAX_SEQ_LEN - 6))  # leaves 6 positions
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                              "max_tokens": 100, "temperature": 0,
                                              "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": MAX_SEQ_LEN - 6, "completion_tokens": 6,
                             "total_tokens": MAX_SEQ_LEN,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_context_overflow(client):
    """api-context-overflow"""
    r = _chat(client, "word " * (MAX_SEQ_LEN + 50))
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert str(MAX_SEQ_LEN) in err["message"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * MAX_SEQ_LEN})
    assert r.status_code == 400 and str(MAX_SEQ_LEN) in r.json()["error"]["message"]


def test_seed(client):
    """api-seed: same seed same text, alone and concurrently; other seed differs."""
    kw = {"temperature": 0.8, "max_tokens": 24, "ignore_eos": True}
    a = _chat(client, seed=7, **kw).json()["choices"][0]["message"]["content"]
    b = _chat(client, seed=7, **kw).json()["choices"][0]["message"]["content"]
    c = _chat(client, seed=8, **kw).json()["choices"][0]["message"]["content"]
    assert a == b and a != c

    async def concurrently():
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120) as ac:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}], **kw}
            rs = await asyncio.gather(*(ac.post("/v1/chat/completions", json={**body, "seed": s})
                                        for s in (7, 7, 8)))
            return [r.json()["choices"][0]["message"]["content"] for r in rs]

    assert asyncio.run(concurrently()) == [a, a, c]


def test_n_stream(client):
    """api-n-stream"""
    kw = {"temperature": 0.9, "seed": 3, "max_tokens": 12, "n": 2}
    body = _chat(client, **kw).json()
    whole = [c["message"]["content"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1]
    events = _stream_chat(client, stream_options={"include_usage": True}, **kw)
    texts, finish = _stream_texts(events[:-1], n=2)
    assert texts == whole
    assert finish == [c["finish_reason"] for c in body["choices"]]
    assert events[-1]["usage"]["completion_tokens"] == body["usage"]["completion_tokens"]
    r = _chat(client, n=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_system_and_empty_messages(client):
    """api-system-and-empty: rendered by the (ChatML) template, never a 500."""
    kw = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    for messages in (
        [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
         {"role": "user", "content": "Hi"}],
        [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Be brief."}],
        [{"role": "user", "content": ""}],
        [{"role": "system", "content": "You only answer in French."}],
    ):
        r = client.post("/v1/chat/completions", json={**kw, "messages": messages})
        assert r.status_code == 200, (messages, r.text)


def test_late_system_message(client):
    """api-late-system-message: kept in place by ChatML (documented in server/chat.py)."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"},
                {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "Color of the sky?"}]
    r = client.post("/v1/chat/completions",
                    json={"model": MODEL, "messages": messages, "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_disconnect_frees_pages(client):
    """api-disconnect: 4 streams, 2 closed early; the others finish as when run alone."""
    kw = {"temperature": 0, "max_tokens": 60, "ignore_eos": True}
    prompts = [f"Tell me a long story about the number {i}." for i in range(4)]
    alone = [_chat(client, prompts[i], **kw).json()["choices"][0]["message"]["content"]
             for i in (0, 1)]
    baseline = wait_idle(client)

    async def run():
        async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120) as ac:

            async def one(i):
                body = {"model": MODEL, "stream": True,
                        "messages": [{"role": "user", "content": prompts[i]}], **kw}
                text, events = "", 0
                async with ac.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        events += 1
                        ch = json.loads(line[6:])["choices"]
                        text += (ch[0]["delta"].get("content") or "") if ch else ""
                        if i >= 2 and events >= 4:
                            return None  # leaving the block closes the connection
                return text

            tasks = [asyncio.create_task(one(i)) for i in range(4)]
            await asyncio.gather(tasks[2], tasks[3])
            # The closed streams leave the engine at once, not after 60 tokens.
            deadline = time.monotonic() + 3
            while True:
                state = (await ac.get("/debug/state")).json()
                if state["num_running"] + state["num_waiting"] <= 2:
                    break
                assert time.monotonic() < deadline, f"aborted streams still running: {state}"
                await asyncio.sleep(0.05)
            return await asyncio.gather(tasks[0], tasks[1])

    finished = asyncio.run(run())
    assert finished == alone
    after = wait_idle(client)
    assert after["pages_used"] - after["prefix_cache_pages"] == 0
    assert baseline["pages_used"] - baseline["prefix_cache_pages"] == 0
    assert after["requests_aborted_total"] >= baseline["requests_aborted_total"] + 2
    t0 = time.monotonic()
    assert _chat(client, max_tokens=4, temperature=0).status_code == 200
    assert time.monotonic() - t0 < 30


def test_non_stream_disconnect_aborts(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Go on and on."}],
            "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    before = client.get("/debug/state").json()["requests_aborted_total"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(str(client.base_url) + "/v1/chat/completions", json=body, timeout=1.0)
    state = wait_idle(client, timeout=5)
    assert state["requests_aborted_total"] == before + 1


def test_invalid_requests(client):
    r = client.post("/v1/chat/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = _chat(client, temperature=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = _chat(client, tool_choice="required")  # no tools to choose from
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = _chat(client, model="other")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


# --------------------------------------------------------------------------- engine failures


# the figures of an idle engine with the fake client's 64 pages
IDLE_STATS = {"num_running": 0, "num_waiting": 0, "pages_total": 64, "pages_free": 64,
              "pages_used": 0, "prompt_tokens_total": 0, "generation_tokens_total": 0,
              "requests_finished_total": 0}


def _fake_client(checkpoint, script):
    from fastapi.testclient import TestClient

    from flare.server.app import create_app

    engine = ScriptedEngine(checkpoint.tokenizer, script, max_seq_len=512, num_pages=64,
                            stats=IDLE_STATS)
    return engine, TestClient(create_app(engine), raise_server_exceptions=False)


def test_engine_error_non_stream_and_stream(checkpoint):
    from flare.runtime.request import RequestOutput

    def script(request):
        yield RequestOutput("", text="partial", num_completion_tokens=1)
        yield RequestOutput("", finished=True, finish_reason="abort", error="boom")

    engine, tc = _fake_client(checkpoint, script)
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}]}
    r = tc.post("/v1/chat/completions", json=body)
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and "boom" in r.json()["error"]["message"]
    r = tc.post("/v1/chat/completions", json={**body, "stream": True})
    events = _events(r)
    assert events[-1] == "[DONE]" and "boom" in events[-2]["error"]["message"]


def test_unexpected_exception_is_500_and_server_keeps_serving(checkpoint):
    from flare.runtime.request import RequestOutput

    calls = []

    def script(request):
        calls.append(request)
        if len(calls) == 1:
            raise RuntimeError("kaboom")
        yield RequestOutput("", text="ok", finished=True, finish_reason="stop",
                            num_prompt_tokens=3, num_completion_tokens=1)

    engine, tc = _fake_client(checkpoint, script)
    body = {"model": "pkg-fake", "messages": [{"role": "user", "content": "x"}], "n": 2,
            "seed": 5}
    r = tc.post("/v1/chat/completions", json=body)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    r = tc.post("/v1/chat/completions", json={**body, "n": 1})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"
    # n=2 submitted choices with seeds 5 and 6, ids suffixed -0 and -1; all were closed.
    assert [c.params.seed for c in calls[:2]] == [5, 6]
    assert [c.request_id[-2:] for c in calls[:2]] == ["-0", "-1"]
    assert len(engine.closed) == 3
