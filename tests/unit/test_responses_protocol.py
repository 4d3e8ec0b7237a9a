"""Responses API conversions (flare.server.responses_protocol): input items -> chat
messages, request fields, and parser events -> stream events -> SSE bytes. Table-driven."""

from __future__ import annotations

import json

import pytest

from flare.server.api_error import ApiError
from flare.server.responses_events import ResponseEvents, sse_bytes, usage_object
from flare.server.responses_protocol import (
    ResponsesRequest,
    input_messages,
    output_messages,
    responses_param,
)
from flare.server.tool_calls import ContentEvent, ToolCall, ToolCallEvent

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}

CASES = [
    ("string", "hi", [{"role": "user", "content": "hi"}], [0]),
    ("easy message without type", [{"role": "user", "content": "hi"}],
     [{"role": "user", "content": "hi"}], [0]),
    ("text parts joined by newline",
     [{"type": "message", "role": "developer",
       "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]}],
     [{"role": "developer", "content": "a\nb"}], [0]),
    ("assistant output_text then its call, then the result",
     [{"type": "message", "role": "user", "content": "q"},
      {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
       "content": [{"type": "output_text", "text": "let me see", "annotations": []}]},
      CALL, {"type": "function_call_output", "call_id": "call_1", "output": "42"}],
     [{"role": "user", "content": "q"},
      {"role": "assistant", "content": "let me see", "tool_calls": [
          {"id": "call_1", "type": "function", "function": {"name": "f",
                                                            "arguments": '{"a": 1}'}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "42"}], [0, 1, 3]),
    ("a call alone starts an assistant message; two calls share it",
     [{"role": "user", "content": "q"}, CALL, {**CALL, "call_id": "call_2",
                                                 "arguments": {"b": "é"}}],
     [{"role": "user", "content": "q"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "call_1", "type": "function", "function": {"name": "f",
                                                            "arguments": '{"a": 1}'}},
          {"id": "call_2", "type": "function", "function": {"name": "f",
                                                            "arguments": '{"b": "é"}'}}]}],
     [0, 1]),
]


@pytest.mark.parametrize("name,items,messages,origin", CASES, ids=[c[0] for c in CASES])
def test_input_items_to_chat_messages(name, items, messages, origin):
    assert input_messages(items) == (messages, origin)


BAD = [
    ("unknown item type", [{"type": "input_image"}], "input[0].type"),
    ("image content part", [{"role": "user", "content": [{"type": "input_image"}]}],
     "input[0].content[0].type"),
    ("bad role", [{"type": "message", "role": "tool", "content": "x"}], "input[0].role"),
    ("no content", [{"type": "message", "role": "user"}], "input[0].content"),
    ("output answering no call", [{"type": "function_call_output", "call_id": "c9",
                                   "output": "x"}], "input[0].call_id"),
    ("call without name", [{"type": "function_call", "call_id": "c", "arguments": "{}"}],
     "input[0].name"),
    ("not an object", ["hello"], "input[0]"),
    ("empty", [], "input"),
]


@pytest.mark.parametrize("name,items,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_items_name_the_field(name, items, param):
    with pytest.raises(ApiError) as e:
        input_messages(items)
    assert e.value.status_code == 400 and e.value.param == param


def test_output_answers_calls_of_the_history():
    out = [{"type": "function_call_output", "call_id": "call_1", "output": "ok"}]
    assert input_messages(out, known_calls=["call_1"])[0] == [
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]


def test_request_fields():
    req = ResponsesRequest.model_validate({
        "model": "m", "input": "x", "tools": [{"type": "function", "name": "f",
                                               "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "p",
                            "schema": {"type": "object"}}},
        "reasoning": {"effort": "low"}, "include": []})
    assert req.tool_mode == "named" and req.forced_tool_name == "f"
    assert req.answer_schema == {"type": "object"}
    assert req.chat_tools() == [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]
    assert req.store is True
    assert responses_param("tools[0].function.parameters") == "tools[0].parameters"
    assert responses_param("response_format") == "text.format"


def _events(pushes, incomplete=False):
    ev = ResponseEvents({"id": "resp_x", "object": "response", "status": "in_progress",
                         "output": []})
    out = ev.start()
    for p in pushes:
        out += ev.push(p)
    out += ev.finish(incomplete, usage_object(5, 3, 2))
    return ev, out


STREAMS = [
    ("text in two deltas", [[ContentEvent("Hel")], [ContentEvent("lo")]], False,
     ["response.created", "response.in_progress", "response.output_item.added",
      "response.content_part.added", "response.output_text.delta",
      "response.output_text.delta", "response.output_text.done",
      "response.content_part.done", "response.output_item.done", "response.completed"]),
    ("text then a call", [[ContentEvent("ok"), ToolCallEvent(0, ToolCall("call_1", "f",
                                                                          "{}"))]], False,
     ["response.created", "response.in_progress", "response.output_item.added",
      "response.content_part.added", "response.output_text.delta",
      "response.output_text.done", "response.content_part.done",
      "response.output_item.done", "response.output_item.added",
      "response.function_call_arguments.delta", "response.function_call_arguments.done",
      "response.output_item.done", "response.completed"]),
    ("nothing, cut: an empty message, incomplete", [], True,
     ["response.created", "response.in_progress", "response.output_item.added",
      "response.content_part.added", "response.output_text.done",
      "response.content_part.done", "response.output_item.done", "response.incomplete"]),
]


@pytest.mark.parametrize("name,pushes,incomplete,types", STREAMS, ids=[s[0] for s in STREAMS])
def test_events_and_sse_bytes(name, pushes, incomplete, types):
    ev, out = _events(pushes, incomplete)
    assert [e["type"] for e in out] == types
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    final = out[-1]["response"]
    assert final["status"] == ("incomplete" if incomplete else "completed")
    assert final["output"] == ev.output and final["usage"]["total_tokens"] == 8
    text = "".join(e["delta"] for e in out if e["type"] == "response.output_text.delta")
    msgs = [o for o in final["output"] if o["type"] == "message"]
    assert text == "".join(m["content"][0]["text"] for m in msgs)
    for e in out:
        wire = sse_bytes(e)
        head, data, tail = wire.split("\n", 2)
        assert head == f"event: {e['type']}" and tail == "\n"
        assert json.loads(data.removeprefix("data: ")) == e


def test_sse_bytes_exact():
    assert sse_bytes({"type": "response.output_text.delta", "sequence_number": 4,
                      "delta": "é"}) == (
        'event: response.output_text.delta\n'
        'data: {"type":"response.output_text.delta","sequence_number":4,"delta":"é"}\n\n')


def test_output_items_back_to_messages():
    ev, _ = _events([[ContentEvent("ok"), ToolCallEvent(0, ToolCall("call_1", "f", "{}"))]])
    assert output_messages(ev.output) == [{"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
