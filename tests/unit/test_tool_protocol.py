"""The request surface of tool calling and structured output: what is accepted, and the 400s
that name the parameter at fault (case api-tool-choice-modes)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flare.server.api_error import validation_error
from flare.server.openai.messages import FunctionCall, ToolCallMessage
from flare.server.openai.protocol import ChatCompletionRequest
from flare.server.openai.replies import AssistantMessage, ChatChoice

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "list_files"}},
]


def _chat(**kw):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return ChatCompletionRequest.model_validate(body)


def _error(**kw):
    with pytest.raises(ValidationError) as exc:
        _chat(**kw)
    return validation_error(exc.value.errors())


@pytest.mark.parametrize("kw, mode, forced", [
    ({}, "none", None),
    ({"tools": TOOLS}, "auto", None),
    ({"tools": TOOLS, "tool_choice": "none"}, "none", None),
    ({"tools": TOOLS, "tool_choice": "auto"}, "auto", None),
    ({"tools": TOOLS, "tool_choice": "required"}, "required", None),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "list_files"}}},
     "named", "list_files"),
    ({"tools": [], "tool_choice": "auto"}, "none", None),
])
def test_tool_modes(kw, mode, forced):
    req = _chat(**kw)
    assert req.tool_mode == mode and req.forced_tool_name == forced


def test_conversation_with_tool_calls_and_results():
    req = _chat(tools=TOOLS, parallel_tool_calls=False, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ])
    assistant, tool = req.messages[1], req.messages[2]
    assert assistant.content is None
    assert assistant.tool_calls[0].function.arguments == '{"city": "Paris"}'  # object -> text
    assert tool.content == "sunny" and tool.tool_call_id == "c1"
    assert req.parallel_tool_calls is False


@pytest.mark.parametrize("fmt", [
    {"type": "text"},
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "p", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}}},
])
def test_response_formats_accepted(fmt):
    assert _chat(response_format=fmt).response_format.type == fmt["type"]


@pytest.mark.parametrize("kw, param, words", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice",
     "not in tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "'required'"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "two tools are named 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name",
     "1-64 characters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "'function'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]},
     "tools[0].function.parameters", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}]}, "tools[0].function.parameters", "must describe an object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "required": "a"}}}}, "response_format.json_schema.schema",
     "not a valid JSON schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "'json_object'"),
    ({"functions": [{"name": "f"}]}, "functions", "use tools"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls", "only assistant"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]},
     "messages[0].tool_calls[0].function", "Missing"),
])
def test_invalid_tool_requests_name_the_param(kw, param, words):
    err = _error(**kw)
    assert err.status_code == 400
    assert err.param == param, err.message
    assert words in err.message


def test_assistant_message_json_shape():
    plain = ChatChoice(index=0, message=AssistantMessage(content="hi"), finish_reason="stop")
    assert plain.model_dump()["message"] == {"role": "assistant", "content": "hi"}
    call = ToolCallMessage(id="call_1", function=FunctionCall(name="f", arguments="{}"))
    calls = ChatChoice(index=0, message=AssistantMessage(content=None, tool_calls=[call]),
                       finish_reason="tool_calls")
    assert calls.model_dump()["message"] == {
        "role": "assistant", "content": None,
        "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "f", "arguments": "{}"}}]}
