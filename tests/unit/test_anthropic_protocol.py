"""The Anthropic Messages surface without a model: recorded request payloads -> the chat
the renderer gets, validation errors -> Anthropic's messages, parser events -> SSE bytes,
finish reasons -> stop reasons, and the guard's refusals in Anthropic's shape (issue 19)."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import ValidationError

from flare.server.anthropic.chat_prompt import chat_messages
from flare.server.anthropic.errors import api_error_message, error_body, messages_status
from flare.server.anthropic.events import (
    StreamEvents,
    content_blocks,
    matched_stop,
    sse,
    stop_reason,
    usage,
)
from flare.server.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    validation_message,
)
from flare.server.api_error import ApiError
from flare.server.guard import RequestGuard
from flare.server.tool_calls import ContentEvent, ToolCall, ToolCallEvent

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER}
OPENAI_TOOL = {"type": "function", "function": {"name": "get_weather",
                                                "description": "Weather in a city",
                                                "parameters": WEATHER}}
CALL = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
        "input": {"city": "Paris", "unit": "°C"}}

# (request payload, expected messages, expected tools, expected prefill)
CONVERSIONS = [
    pytest.param({"messages": [{"role": "user", "content": "Hi"}]},
                 [{"role": "user", "content": "Hi"}], None, "", id="string-content"),
    pytest.param({"system": [{"type": "text", "text": "A"},
                             {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}}],
                  "messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                            {"type": "text", "text": "y"}]}]},
                 [{"role": "system", "content": "A\nB"}, {"role": "user", "content": "x\ny"}],
                 None, "", id="system-blocks-and-text-blocks"),
    pytest.param({"system": "S", "tools": [TOOL], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, CALL]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "text", "text": "And tomorrow?"}]}]},
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": "Let me look.", "tool_calls": [
             {"id": "toolu_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris", "unit": "°C"}'}}]},
         {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
         {"role": "user", "content": "And tomorrow?"}],
        [OPENAI_TOOL], "", id="tool-loop"),
    pytest.param({"tools": [TOOL], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [CALL]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [{"type": "text", "text": "no"}, {"type": "text", "text": "network"}]}]}]},
        [{"role": "user", "content": "Weather?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "toolu_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": '{"city": "Paris", "unit": "°C"}'}}]},
         {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no\nnetwork"}],
        [OPENAI_TOOL], "", id="calls-only-and-error-result"),
    pytest.param({"tools": [TOOL], "tool_choice": {"type": "none"},
                  "messages": [{"role": "user", "content": "Hi"}]},
                 [{"role": "user", "content": "Hi"}], None, "", id="tool-choice-none"),
    pytest.param({"messages": [{"role": "user", "content": "Count"},
                               {"role": "assistant", "content": "1, 2,"}]},
                 [{"role": "user", "content": "Count"}], None, "1, 2,", id="prefill"),
]


@pytest.mark.parametrize("payload, messages, tools, prefill", CONVERSIONS)
def test_request_to_chat_messages(payload, messages, tools, prefill):
    prompt = chat_messages(CountTokensRequest.model_validate({"model": "m", **payload}))
    assert prompt.messages == messages
    assert prompt.tools == tools
    assert prompt.prefill == prefill


@pytest.mark.parametrize("choice, mode, parallel", [
    (None, "auto", True),
    ({"type": "auto", "disable_parallel_tool_use": True}, "auto", False),
    ({"type": "any"}, "required", True),
    ({"type": "tool", "name": "get_weather"}, "named", True),
    ({"type": "none"}, "none", True),
])
def test_tool_choice_modes(choice, mode, parallel):
    body = {"model": "m", "max_tokens": 4, "tools": [TOOL],
            "messages": [{"role": "user", "content": "x"}]}
    if choice is not None:
        body["tool_choice"] = choice
    req = MessagesRequest.model_validate(body)
    assert (req.tool_mode, req.parallel) == (mode, parallel)


def test_sampling_params():
    req = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "temperature": 0, "top_p": 0.5, "top_k": 3,
        "stop_sequences": ["END"], "metadata": {"user_id": "u"},
        "messages": [{"role": "user", "content": "x"}]})
    p = req.sampling_params(7)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop) == (7, 0, 0.5, 3, ("END",))
    assert MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "x"}]}).sampling_params(1).temperature == 1.0


USER = [{"role": "user", "content": "x"}]

# (payload without model, the start of the 400's message)
INVALID = [
    ({"messages": USER}, "max_tokens: Field required"),
    ({"max_tokens": "5", "messages": USER}, "max_tokens: Input should be a valid integer"),
    ({"max_tokens": 0, "messages": USER}, "max_tokens: Input should be greater than"),
    ({"max_tokens": 5, "messages": []}, "messages: List should have at least 1 item"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": ""}}]}]},
     "messages.0.content: content block 0 has type 'image'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}]}, "messages.0.content.0.text: Input should be a valid"),
    ({"max_tokens": 5, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": [CALL]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "image"}]}]}]},
     "messages.2.content.0.content: content block 0 has type 'image'"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [CALL]}]},
     "messages.0: Value error, tool_use blocks belong in assistant messages"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "nope", "content": "x"}]}]},
     "messages: message 0 has a tool_result for tool_use_id 'nope'"),
    ({"max_tokens": 5, "messages": USER, "tools": [{"type": "web_search_20250305",
                                                    "name": "web_search"}]},
     "tools.0: tool type 'web_search_20250305' is not supported"),
    ({"max_tokens": 5, "messages": USER, "tools": [{**TOOL, "input_schema": {
        "type": "string"}}]}, "tools.0.input_schema: input_schema must describe an object"),
    ({"max_tokens": 5, "messages": USER, "tools": [TOOL],
      "tool_choice": {"type": "tool", "name": "other"}},
     "tool_choice: tool_choice names tool 'other', which is not in tools (get_weather)"),
    ({"max_tokens": 5, "messages": USER, "tool_choice": {"type": "any"}},
     "tool_choice: tool_choice 'any' needs tools"),
    ({"max_tokens": 5, "messages": USER, "tools": [TOOL], "tool_choice": {"type": "tool"}},
     "tool_choice: Value error, tool_choice of type 'tool' needs the tool's name"),
    ({"max_tokens": 5, "messages": USER, "temperature": 1.5},
     "temperature: Input should be less than or equal to 1"),
    ({"max_tokens": 5, "messages": USER, "stop_sequences": [""]},
     "stop_sequences: stop sequences must not be empty"),
]


@pytest.mark.parametrize("payload, message", INVALID)
def test_invalid_requests_name_the_field(payload, message):
    with pytest.raises(ValidationError) as info:
        MessagesRequest.model_validate({"model": "m", **payload})
    got = validation_message(info.value.errors())
    assert got.replace("Value error, ", "").startswith(message.replace("Value error, ", "")), got


def test_count_tokens_needs_no_max_tokens():
    assert CountTokensRequest.model_validate({"model": "m", "messages": USER}).messages


# --------------------------------------------------------------------------- responses


def test_content_blocks_and_usage():
    call = ToolCall("call_abc", "get_weather", '{"city": "Paris"}')
    assert content_blocks("Sure.", [call]) == [
        {"type": "text", "text": "Sure."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
         "input": {"city": "Paris"}}]
    assert content_blocks("", []) == []
    assert usage(100, 64, 7) == {"input_tokens": 36, "output_tokens": 7,
                                 "cache_read_input_tokens": 64,
                                 "cache_creation_input_tokens": 0}


@pytest.mark.parametrize("finish, calls, matched, expected", [
    ("length", False, None, ("max_tokens", None)),
    ("length", True, None, ("max_tokens", None)),
    ("stop", True, None, ("tool_use", None)),
    ("stop", False, "END", ("stop_sequence", "END")),
    ("stop", False, None, ("end_turn", None)),
])
def test_stop_reason(finish, calls, matched, expected):
    assert stop_reason(finish, calls, matched) == expected


@pytest.mark.parametrize("text, stops, expected", [
    ("abc END def", ["END", "def"], "END"),
    ("abc END def", ["def", "END"], "END"),
    ("abENDc", ["END", "ENDc"], "END"),
    ("no stop here", ["END"], None),
])
def test_matched_stop_is_the_earliest(text, stops, expected):
    assert matched_stop(text, stops) == expected


def test_stream_events_bytes():
    ev = StreamEvents("msg_1", "m")
    call = ToolCall("call_ff", "get_weather", '{"city": "Zürich"}')
    out = ev.start(usage(10, 4, 0))
    out += ev.events([ContentEvent("Hel"), ContentEvent("lo")])
    out += ev.events([ContentEvent("!"), ToolCallEvent(0, call)])
    out += ev.finish("tool_use", None, usage(10, 4, 5))
    u0 = '"usage":{"input_tokens":6,"output_tokens":0,"cache_read_input_tokens":4,' \
         '"cache_creation_input_tokens":0}'
    u1 = u0.replace('"output_tokens":0', '"output_tokens":5')
    assert "".join(out) == (
        'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1",'
        '"type":"message","role":"assistant","model":"m","content":[],"stop_reason":null,'
        f'"stop_sequence":null,{u0}}}}}\n\n'
        'event: ping\ndata: {"type":"ping"}\n\n'
        'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        '"content_block":{"type":"text","text":""}}\n\n'
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"Hello"}}\n\n'
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"!"}}\n\n'
        'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
        'event: content_block_start\ndata: {"type":"content_block_start","index":1,'
        '"content_block":{"type":"tool_use","id":"toolu_ff","name":"get_weather",'
        '"input":{}}}\n\n'
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
        '"delta":{"type":"input_json_delta","partial_json":"{\\"city\\": \\"Zürich\\"}"}}\n\n'
        'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}\n\n'
        'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":'
        f'"tool_use","stop_sequence":null}},{u1}}}\n\n'
        'event: message_stop\ndata: {"type":"message_stop"}\n\n')


def test_empty_reply_has_no_blocks():
    ev = StreamEvents("msg_2", "m")
    assert ev.events([]) == [] and ev.text("") == []
    assert [e.split("\n")[0] for e in ev.finish("end_turn", None, usage(1, 0, 1))] == [
        "event: message_delta", "event: message_stop"]


def test_sse_and_error_event():
    assert sse("ping", {"type": "ping"}) == 'event: ping\ndata: {"type":"ping"}\n\n'
    body = error_body(529, "busy")
    assert StreamEvents.error(body) == (
        'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
        '"message":"busy"}}\n\n')


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"),
    (504, "timeout_error"), (529, "overloaded_error"), (503, "api_error"),
    (409, "invalid_request_error")])
def test_error_types(status, kind):
    assert error_body(status, "m") == {"type": "error", "error": {"type": kind, "message": "m"}}


def test_core_errors_in_anthropic_words():
    too_long = ApiError(400, "This model's maximum context length is 8 tokens.",
                        param="messages", code="context_length_exceeded")
    assert api_error_message(too_long).startswith("prompt is too long: ")
    assert api_error_message(ApiError(404, "no such model", param="model")) == \
        "model: no such model"
    assert messages_status(ApiError(429, "full", code="queue_full")) == 529


# --------------------------------------------------------------------------- the guard


def _guarded(waiting: int = 0) -> TestClient:
    app = FastAPI()

    @app.post("/v1/messages")
    async def messages(request: Request):
        return {"got": len(await request.body())}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return {"got": len(await request.body())}

    return TestClient(RequestGuard(app, api_key="k", max_body_bytes=64, protect_metrics=False,
                                   queue_length=lambda: waiting, max_queue=1))


@pytest.mark.parametrize("headers, status", [
    ({"x-api-key": "k"}, 200), ({"Authorization": "Bearer k"}, 200),
    ({"x-api-key": "bad"}, 401), ({}, 401)])
def test_guard_takes_x_api_key_and_answers_anthropic_shape(headers, status):
    client = _guarded()
    r = client.post("/v1/messages", content=b"{}", headers=headers)
    assert r.status_code == status
    if status == 401:
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "authentication_error"
    # the OpenAI routes keep OpenAI's shape, and take x-api-key too
    r = client.post("/v1/chat/completions", content=b"{}", headers=headers)
    assert r.status_code == status
    if status == 401:
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_guard_too_large_and_queue_full_on_messages():
    r = _guarded().post("/v1/messages", content=b"x" * 100, headers={"x-api-key": "k"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = _guarded(waiting=5).post("/v1/messages", content=b"{}", headers={"x-api-key": "k"})
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    assert r.headers["retry-after"] == "1"
    r = _guarded(waiting=5).post("/v1/chat/completions", content=b"{}",
                                 headers={"x-api-key": "k"})
    assert r.status_code == 429 and json.loads(r.text)["error"]["code"] == "queue_full"
