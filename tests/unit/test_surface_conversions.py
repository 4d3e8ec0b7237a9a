"""The three API surfaces over one scripted core, table-driven (issue 19, item 4).

A stand-in engine answers every request with recorded model output (split into 5-character
outputs, as the engine streams it) and a recorded finish reason; the real app
(`create_app`) serves it through each surface's official SDK (`openai` chat and responses,
`anthropic` messages) over an in-process transport, streamed and not:

- request -> core request: the same conversation sent to each surface reaches the core as
  the same prompt token ids, budget and sampling, with a forcing grammar exactly when the
  tool choice forces calls;
- core stream -> protocol: each recorded stream (forced answers cut by max_tokens after a
  call or inside the first one, free answers, two calls) ends with the reason, text and
  calls the table gives, streamed equal to non-streamed (cases
  api-tool-required-parallel-default, api-tool-stream-indices).
"""

from __future__ import annotations

import json

import pytest
from anthropic_replies import anthropic_message, text_and_tool_uses
from scripted_engine import ScriptedEngine, answer

anthropic = pytest.importorskip("anthropic")

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SPECS = {"get_weather": ("Weather in a city", WEATHER),
         "list_files": ("List files", {"type": "object", "properties": {}})}
SYSTEM = "Be brief."
ASK = "What is the weather in Paris?"

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CUT_SECOND = CALL + '\n<tool_call>\n{"name": "get_weather", "'  # SmolLM2, max_tokens 48
CUT_FIRST = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
TWO_CALLS = CALL + '\n<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>'
PARIS = ("get_weather", {"city": "Paris"})

# (id, recorded text, engine finish reason, tool mode, expected text, expected calls,
#  expected (chat finish_reason, anthropic stop_reason, response status))
STREAMS = [
    ("forced-cut-after-a-call", CUT_SECOND, "length", "required", "", [PARIS],
     ("tool_calls", "tool_use", "completed")),
    ("named-cut-after-a-call", CUT_SECOND, "length", "named", "", [PARIS],
     ("tool_calls", "tool_use", "completed")),
    ("forced-cut-inside-the-call", CUT_FIRST, "length", "named", "", [],
     ("length", "max_tokens", "incomplete")),
    ("forced-two-calls", TWO_CALLS, "stop", "required", "",
     [PARIS, ("list_files", {})], ("tool_calls", "tool_use", "completed")),
    ("auto-cut-after-a-call", CUT_SECOND, "length", "auto", CUT_SECOND[len(CALL) + 1:],
     [PARIS], ("length", "max_tokens", "incomplete")),
    ("auto-text", "It is sunny.", "stop", "auto", "It is sunny.", [],
     ("stop", "end_turn", "completed")),
    ("auto-text-cut", "It is sun", "length", "auto", "It is sun", [],
     ("length", "max_tokens", "incomplete")),
]


@pytest.fixture(scope="module")
def surfaces(smollm2_tokenizer):
    """(engine, openai client, anthropic client) over one app."""
    from fastapi.testclient import TestClient
    from openai import OpenAI

    from flare.server.app import create_app

    engine = ScriptedEngine(smollm2_tokenizer, answer(""))
    http = TestClient(create_app(engine), raise_server_exceptions=False)
    oai = OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    ant = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=http,
                              max_retries=0)
    return engine, oai, ant


# ---- one surface each: (text, [(name, args)], reason) from a request -------------------


def _chat(oai, mode, stream):
    tools = [{"type": "function", "function": {"name": n, "description": d, "parameters": p}}
             for n, (d, p) in SPECS.items()]
    choice = {"named": {"type": "function", "function": {"name": "get_weather"}},
              "required": "required", "auto": "auto"}[mode]
    kw = dict(model="fake", messages=[{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": ASK}],
              tools=tools, tool_choice=choice, max_tokens=48, temperature=0)
    if not stream:
        c = oai.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, json.loads(t.function.arguments))
                 for t in c.message.tool_calls or ()]
        return c.message.content or "", calls, c.finish_reason
    text, calls, reason = "", {}, None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            text += c.delta.content or ""
            for t in c.delta.tool_calls or ():
                entry = calls.setdefault(t.index, [t.function.name, ""])
                entry[1] += t.function.arguments or ""
            reason = c.finish_reason or reason
    return text, [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))], reason


def _messages(ant, mode, stream):
    tools = [{"name": n, "description": d, "input_schema": p} for n, (d, p) in SPECS.items()]
    choice = {"named": {"type": "tool", "name": "get_weather"}, "required": {"type": "any"},
              "auto": {"type": "auto"}}[mode]
    kw = dict(model="fake", system=SYSTEM, messages=[{"role": "user", "content": ASK}],
              tools=tools, tool_choice=choice, max_tokens=48, extra_body={"temperature": 0})
    r = anthropic_message(ant, stream, **kw)
    text, uses = text_and_tool_uses(r)
    return text, [(b.name, b.input) for b in uses], r.stop_reason


def _responses(oai, mode, stream):
    tools = [{"type": "function", "name": n, "description": d, "parameters": p}
             for n, (d, p) in SPECS.items()]
    choice = {"named": {"type": "function", "name": "get_weather"}, "required": "required",
              "auto": "auto"}[mode]
    kw = dict(model="fake", instructions=SYSTEM, input=ASK, tools=tools, tool_choice=choice,
              max_output_tokens=48, temperature=0, store=False)
    if stream:  # the SDK's stream helper wants response.completed: read the events
        ends = [e.response for e in oai.responses.create(stream=True, **kw)
                if e.type in ("response.completed", "response.incomplete")]
        (r,) = ends
    else:
        r = oai.responses.create(**kw)
    calls = [(o.name, json.loads(o.arguments)) for o in r.output if o.type == "function_call"]
    return r.output_text, calls, r.status


SURFACES = [(_chat, 0), (_messages, 1), (_responses, 2)]


@pytest.mark.parametrize("name, text, engine_reason, mode, want_text, want_calls, reasons",
                         STREAMS, ids=[s[0] for s in STREAMS])
@pytest.mark.parametrize("surface, which", SURFACES, ids=["chat", "messages", "responses"])
def test_core_stream_to_protocol(surfaces, surface, which, name, text, engine_reason, mode,
                                 want_text, want_calls, reasons):
    engine, oai, ant = surfaces
    engine.script = answer(text, engine_reason)
    client = ant if surface is _messages else oai
    whole = surface(client, mode, stream=False)
    assert whole == (want_text, want_calls, reasons[which])
    assert surface(client, mode, stream=True) == whole  # streamed equals non-streamed
    assert "<tool_call>" not in whole[0] or mode == "auto"


@pytest.mark.parametrize("mode", ["named", "required", "auto"])
def test_same_conversation_same_core_request(surfaces, mode):
    """One conversation (system, user, two tools) sent to each surface reaches the core as
    one request: prompt ids, budget, temperature; a grammar exactly when calls are forced."""
    engine, oai, ant = surfaces
    engine.script = answer("ok")
    got = []
    for surface, _ in SURFACES:
        surface(ant if surface is _messages else oai, mode, stream=False)
        r = engine.requests[-1]
        got.append((r.prompt_token_ids, r.params.max_tokens, r.params.temperature,
                    r.constraint is not None))
    assert got[0] == got[1] == got[2]
    assert got[0][1:] == (48, 0.0, mode != "auto")
