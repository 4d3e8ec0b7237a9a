"""Anthropic's Messages API end to end with the official `anthropic` SDK (issue 19).

A real `flare serve` process over the embedded model (SmolLM2-135M, whose template has no
tool support, so Flare's fallback prompt is what it reads), with `--api-key`: plain and
streamed messages (`client.messages.stream`), a two-step tool loop with the prefix cache,
count_tokens, and each refusal as the SDK's exception class with Anthropic's error body.
Requests are few and short (max_tokens <= 48, greedy).
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from server_process import ServerProcess

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

KEY = "sk-flare-anthropic-test"
MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0}  # the SDK's own keyword is gone in 2.x; the API still takes it
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city",
          "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HELLO = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server(smollm2_package, tmp_path_factory):
    srv = ServerProcess(smollm2_package, tmp_path_factory.mktemp("anthropic") / "serve.log",
                        ("--api-key", KEY))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _check_error(exc_info, kind: str) -> None:
    body = exc_info.value.body
    assert body["type"] == "error", body
    assert body["error"]["type"] == kind and body["error"]["message"], body


def test_streamed_message_equals_non_streamed(client):
    reply = client.messages.create(model=MODEL, max_tokens=16, messages=HELLO,
                                   system="Answer briefly.", extra_body=GREEDY)
    assert reply.type == "message" and reply.role == "assistant" and reply.model
    assert reply.id.startswith("msg_")
    (block,) = reply.content
    assert block.type == "text" and block.text
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    assert reply.usage.output_tokens > 0 and reply.usage.cache_creation_input_tokens == 0

    with client.messages.stream(model=MODEL, max_tokens=16, messages=HELLO,
                                system="Answer briefly.", extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text
    assert [b.model_dump(exclude_none=True) for b in final.content] == [
        {"type": "text", "text": block.text}]
    assert (final.stop_reason, final.usage.output_tokens) == (reply.stop_reason,
                                                                reply.usage.output_tokens)
    # the whole prompt is counted once: computed now + read from the cache
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == reply.usage.input_tokens + reply.usage.cache_read_input_tokens)


def test_raw_event_order_and_stop_sequence(server):
    """The SSE framing itself: message_start, ping, blocks, message_delta, message_stop;
    and a stop sequence is named as the stop reason. Bearer auth here."""
    body = {"model": MODEL, "max_tokens": 24, "stream": True, "temperature": 0,
            "stop_sequences": ["def"],
            "messages": [{"role": "user", "content": "Write a Python function that "
                                                     "reverses a string."}]}
    events = []
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_text():
            events.append(chunk)
    raw = "".join(events)
    frames = [f for f in raw.split("\n\n") if f]
    names = [f.split("\n")[0].removeprefix("event: ") for f in frames]
    for f in frames:
        name, data = f.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                     "message_stop"]
    delta = json.loads(frames[-2].split("\n")[1].removeprefix("data: "))
    if delta["delta"]["stop_reason"] == "stop_sequence":
        assert delta["delta"]["stop_sequence"] == "def"
    else:  # the model never wrote "def" within max_tokens
        assert delta["delta"]["stop_reason"] == "max_tokens"


def test_tool_loop_reuses_the_prefix_and_count_tokens(server, client):
    first = client.messages.create(model=MODEL, max_tokens=48, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)

    messages = ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                          for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": '{"temp_c": 21, "sky": "sunny"}'}]},
    ]
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0,
                                 timeout=120)
    with bearer.messages.stream(model=MODEL, max_tokens=16, messages=messages, tools=TOOLS,
                                extra_body=GREEDY) as stream:
        second = stream.get_final_message()
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert second.content
    assert second.usage.cache_read_input_tokens > 0  # the first turn's prompt, reused
    prompt = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert prompt > first.usage.input_tokens + first.usage.cache_read_input_tokens

    count = client.messages.count_tokens(model=MODEL, messages=messages, tools=TOOLS)
    assert count.input_tokens == prompt


def test_errors_are_anthropic_shaped(server, client):
    with pytest.raises(anthropic.BadRequestError) as e:  # the SDK checks max_tokens itself
        client.messages.create(model=MODEL, max_tokens=anthropic.omit, messages=ASK,
                               timeout=60)
    _check_error(e, "invalid_request_error")
    assert "max_tokens" in e.value.body["error"]["message"]

    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])
    _check_error(e, "invalid_request_error")
    assert "'image'" in e.value.body["error"]["message"]

    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="no-such-model", max_tokens=8, messages=ASK)
    _check_error(e, "not_found_error")

    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=ASK, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "send_email"})
    _check_error(e, "invalid_request_error")
    assert "send_email" in e.value.body["error"]["message"]

    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, max_tokens=8, messages=ASK)
    _check_error(e, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model=MODEL, messages=ASK)

    r = httpx.get(server.url + "/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/messages/batches", headers={"x-api-key": KEY}, json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": KEY,
                                                          "content-type": "application/json"},
                   content=b'{"model": ')
    assert r.status_code == 400 and r.json()["type"] == "error"

    # the server kept serving through all of it
    assert httpx.get(server.url + "/health").status_code == 200
    ok = client.messages.count_tokens(model=MODEL, messages=ASK)
    assert ok.input_tokens > 0
