"""The agent API end to end with the official `openai` client.

A real uvicorn server over the real engine and the embedded model (SmolLM2-135M, whose
template has no tool support, so Flare's fallback prompt is what it reads) for tool loops,
forced calls and structured output; a scripted engine behind the same app for model outputs
a 135M model will not produce on demand (two calls in one answer, malformed markup).

Cases from cases/api.md: api-tool-choice-modes, api-tool-stream-indices.
Requests are few and short (max_tokens <= 100, greedy).
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from scripted_engine import ScriptedEngine, answer
from server_thread import embedded_server_fixture

pytestmark = pytest.mark.slow

MODEL = "smollm2-agent"
MAX_SEQ_LEN = 1024

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "list_files",
                                      "description": "List the files in the working folder"}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"type": "string", "enum": ["cat", "dog", "fish"]},
                 "minItems": 1, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "country": {"type": "string", "enum": ["FR", "DE", "US"]}},
                    "required": ["city", "country"], "additionalProperties": False},
    },
    "required": ["name", "age", "pets", "address"], "additionalProperties": False,
}


# --------------------------------------------------------------------------- fixtures


server = embedded_server_fixture(max_seq_len=MAX_SEQ_LEN, model=MODEL,
                                package_id="pkg-agent", tool_parser="auto")


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(client, messages=ASK, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def _stream(client, messages=ASK, **kw):
    """Streamed chat reassembled: (content, [(id, name, arguments)], finish, last chunk)."""
    content, calls, finish, last = "", {}, None, None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                stream=True, **kw):
        last = chunk
        for choice in chunk.choices:
            assert finish is None, "a delta after finish_reason"
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name, "first delta of a call: id and name"
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.id is None and tc.function.name is None
                calls[tc.index][2] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    assert sorted(calls) == list(range(len(calls))), "call indices 0, 1, ..."
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, last


@pytest.fixture(scope="module")
def named_reply(client):
    return _chat(client, tools=TOOLS, tool_choice=NAMED, max_tokens=48, seed=3)


# --------------------------------------------------------------------------- real model


def test_named_tool_call_valid_for_schema_api_tool_choice_modes(named_reply):
    """api-tool-choice-modes: a named function always yields a call valid for its schema."""
    choice = named_reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_tool_result_goes_back_and_next_turn_completes(server, client, named_reply):
    """The agent loop: the call and its result go back (role tool); the next turn answers
    and, where the engine keeps a prefix cache, reuses the conversation's state."""
    call = named_reply.choices[0].message.tool_calls[0]
    messages = ASK + [
        named_reply.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21, "sky": "sunny"}'},
    ]
    reply = _chat(client, messages, tools=TOOLS, max_tokens=16)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    assert reply.usage.prompt_tokens > named_reply.usage.prompt_tokens
    if getattr(server.engine.engine, "prefix_index", None) is not None:
        assert reply.usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_tool_call_equals_non_streamed_api_tool_stream_indices(client, named_reply):
    """api-tool-stream-indices: deltas reassemble into exactly the non-streamed call."""
    content, calls, finish, last = _stream(client, tools=TOOLS, tool_choice=NAMED,
                                           max_tokens=48, seed=3)
    (expected,) = named_reply.choices[0].message.tool_calls
    assert content == "" and finish == "tool_calls"
    assert [(name, args) for _, name, args in calls] == [
        (expected.function.name, expected.function.arguments)]
    assert last.model_extra["flare"]["choices"][0]["clock"] == "server_monotonic_ns"


def test_required_yields_a_valid_call_api_tool_choice_modes(client):
    reply = _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=48)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    params = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
    assert call.function.name in params
    schema = params[call.function.name] or {"type": "object", "maxProperties": 0}
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_choice_none_never_returns_tool_calls_api_tool_choice_modes(client, named_reply):
    """Even with a tool call in the history for the model to imitate."""
    call = named_reply.choices[0].message.tool_calls[0]
    messages = ASK + [named_reply.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
                      {"role": "user", "content": "And in Berlin?"}]
    reply = _chat(client, messages, tools=TOOLS, tool_choice="none", max_tokens=24)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_auto_lets_the_model_answer_in_text_api_tool_choice_modes(client):
    reply = _chat(client, [{"role": "user", "content": "Just say hello, do not use any tool."}],
                  tools=TOOLS, tool_choice="auto", max_tokens=16)
    choice = reply.choices[0]
    if choice.message.tool_calls is None:  # auto is not forced into a call
        assert choice.finish_reason in ("stop", "length") and choice.message.content
    else:
        assert choice.finish_reason == "tool_calls"


def test_response_format_json_schema_validates_stream_and_not(client):
    messages = [{"role": "user", "content": "Describe a person who lives in Paris with two "
                                            "pets, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    reply = _chat(client, messages, response_format=fmt, max_tokens=100)
    assert reply.choices[0].finish_reason == "stop"
    text = reply.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    content, calls, finish, _ = _stream(client, messages, response_format=fmt, max_tokens=100)
    assert content == text and calls == [] and finish == "stop"


def test_response_format_json_object(client):
    messages = [{"role": "user", "content": "Give a JSON object with the keys city and "
                                            "country for Paris."}]
    reply = _chat(client, messages, response_format={"type": "json_object"}, max_tokens=40)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)


def test_flare_extension_in_final_response(named_reply):
    ext = named_reply.model_extra["flare"]
    (entry,) = ext["choices"]
    assert entry["index"] == 0 and entry["request_id"].endswith("-0")
    t = entry["timings"]
    assert entry["clock"] == "server_monotonic_ns"
    assert t["arrival_ns"] <= t["scheduled_ns"] <= t["first_token_ns"] <= t["finished_ns"]
    assert "reuse" in entry


def test_schema_errors_are_400_naming_the_field(client):
    import openai

    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"not": {"type": "string"}}}}, max_tokens=4)
    assert exc.value.body["param"] == "response_format"
    assert exc.value.body["code"] == "unsupported_schema"
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, tool_choice="required", max_tokens=4)
    assert exc.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as exc:
        _chat(client, tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": 5}}}}}],
            max_tokens=4)
    assert exc.value.body["param"] == "tools[0].function.parameters"


# --------------------------------------------------------------------------- scripted model

TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
             '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "list_files", "arguments": {}}\n'
             '</tool_call>')
SHELL = ('Creating them.\n<tool_call>\n{"name": "run_shell", "arguments": {"command": '
         '"mkdir -p a/{b,c} && echo \\"}\\" > \'q\'"}}\n</tool_call>')
BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'
SHELL_TOOL = {"type": "function", "function": {
    "name": "run_shell", "parameters": {"type": "object",
                                        "properties": {"command": {"type": "string"}}}}}


def _scripted_client(tokenizer, text):
    from fastapi.testclient import TestClient
    from openai import OpenAI

    from flare.server.app import create_app

    engine = ScriptedEngine(tokenizer, answer(text))
    http = TestClient(create_app(engine), raise_server_exceptions=False)
    return engine, OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http,
                          max_retries=0)


def _scripted_chat(client, tools, stream=False, **kw):
    return client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "x"}], tools=tools, stream=stream,
        **kw)


def test_two_calls_stream_indices_api_tool_stream_indices(embedded_checkpoint):
    """api-tool-stream-indices: index 0 and 1, distinct ids, name first, arguments after,
    `{}` for a tool without parameters, finish tool_calls, equal to non-streamed."""
    _, client = _scripted_client(embedded_checkpoint.tokenizer, TWO_CALLS)
    whole = _scripted_chat(client, TOOLS).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert expected == [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                        ("list_files", "{}")]
    content, calls, finish, _ = _stream_scripted(client, TOOLS)
    assert content == "" and finish == "tool_calls"
    assert [(name, args) for _, name, args in calls] == expected
    assert len({cid for cid, _, _ in calls}) == 2


def _stream_scripted(client, tools, **kw):
    content, calls, finish = "", {}, None
    for chunk in _scripted_chat(client, tools, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function.name
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                calls[tc.index][2] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, None


def test_braces_and_quotes_in_arguments_api_tool_stream_indices(embedded_checkpoint):
    _, client = _scripted_client(embedded_checkpoint.tokenizer, SHELL)
    content, calls, finish, _ = _stream_scripted(client, [SHELL_TOOL])
    assert content == "Creating them." and finish == "tool_calls"
    assert json.loads(calls[0][2]) == {"command": "mkdir -p a/{b,c} && echo \"}\" > 'q'"}
    whole = _scripted_chat(client, [SHELL_TOOL]).choices[0].message
    assert whole.content == "Creating them."
    assert whole.tool_calls[0].function.arguments == calls[0][2]


def test_malformed_output_is_content_never_500_api_tool_stream_indices(embedded_checkpoint):
    _, client = _scripted_client(embedded_checkpoint.tokenizer, BROKEN)
    whole = _scripted_chat(client, TOOLS).choices[0]
    assert whole.finish_reason == "stop" and whole.message.tool_calls is None
    assert whole.message.content == BROKEN
    content, calls, finish, _ = _stream_scripted(client, TOOLS)
    assert (content, calls, finish) == (BROKEN, [], "stop")


def test_tool_choice_none_does_not_parse_api_tool_choice_modes(embedded_checkpoint):
    engine, client = _scripted_client(embedded_checkpoint.tokenizer, TWO_CALLS)
    whole = _scripted_chat(client, TOOLS, tool_choice="none").choices[0]
    assert whole.message.tool_calls is None and whole.message.content == TWO_CALLS
    assert whole.finish_reason == "stop"
    assert engine.requests[-1].constraint is None
    # and the tools were not described to the model
    with_tools = _scripted_chat(client, TOOLS)
    assert len(engine.requests[-1].prompt_token_ids) > len(engine.requests[-2].prompt_token_ids)
    assert with_tools.choices[0].finish_reason == "tool_calls"


def test_forced_choice_attaches_a_constraint_per_choice(embedded_checkpoint):
    engine, client = _scripted_client(embedded_checkpoint.tokenizer, TWO_CALLS)
    _scripted_chat(client, TOOLS, tool_choice="required", n=2)
    a, b = engine.requests[-2:]
    assert a.constraint is not None and b.constraint is not None
    assert a.constraint is not b.constraint
