"""Tool-call parsers on recorded model outputs (cases api-tool-stream-indices and
api-tool-choice-modes).

Each recorded output is parsed whole (the non-streamed response) and streamed split at
every point (and character by character); both must give the same content and calls. Outputs
marked "SmolLM2" were produced by the embedded model under Flare's forcing grammar; the
Qwen-style ones follow the Hermes markup Qwen2.5/Qwen3 write; the Llama ones the Llama 3.1
JSON tool format.
"""

from __future__ import annotations

import json

import pytest

from flare.server.tool_calls import ContentEvent, ToolCallEvent, collect
from flare.server.tool_formats import FORMATS, detect_format, get_format
from flare.server.tool_parsers import HermesParser, Llama3JsonParser

TOOLS = {"get_weather", "run_shell", "list_files", "search"}

# --------------------------------------------------------------------------- recorded outputs

# (name, output, expected content, expected [(name, arguments object)])
HERMES_CASES = [
    (
        "smollm2_forced_named",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>",
        "",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    (
        "qwen_single",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Berlin"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Berlin"})],
    ),
    (
        "qwen_two_calls",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris"}), ("list_files", {})],
    ),
    (
        "content_then_call",
        "I'll check the weather for you.\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        "I'll check the weather for you.",
        [("get_weather", {"city": "Rome"})],
    ),
    (
        "braces_and_quotes_in_strings",
        '<tool_call>\n{"name": "run_shell", "arguments": {"command": "mkdir -p a/{b,c} && '
        'echo \\"}{\\" > \'x\' # </tool_call> {"}}\n</tool_call>',
        "",
        [("run_shell", {"command": "mkdir -p a/{b,c} && echo \"}{\" > 'x' # </tool_call> {"})],
    ),
    (
        "escaped_backslash_before_quote",
        '<tool_call>\n{"name": "search", "arguments": {"q": "C:\\\\dir\\\\", "n": [1, {"k": '
        '"]"}]}}\n</tool_call>',
        "",
        [("search", {"q": "C:\\dir\\", "n": [1, {"k": "]"}]})],
    ),
    (
        "no_parameters_tool_and_compact_json",
        '<tool_call>{"name":"list_files","arguments":{}}</tool_call>',
        "",
        [("list_files", {})],
    ),
    (
        "arguments_double_encoded",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n'
        "</tool_call>",
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "missing_close_tag_at_end",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima"}}\n',
        "",
        [("get_weather", {"city": "Lima"})],
    ),
    (
        "text_after_call",
        '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>\nDone.',
        "Done.",
        [("list_files", {})],
    ),
    # malformed: returned as content, raw, never as a half-parsed call
    (
        "malformed_json",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }}\n</tool_call>',
        [],
    ),
    (
        "missing_opening_tag",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        [],
    ),
    (
        "unterminated_call_cut_by_length",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        [],
    ),
    (
        "unknown_tool_name",
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',
        [],
    ),
    (
        "arguments_not_an_object",
        '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',
        [],
    ),
    (
        "markup_inside_unfinished_json_then_good_call",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}\n'
        '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}',
        [("list_files", {})],
    ),
    (
        "junk_between_object_and_close",
        '<tool_call>\n{"name": "list_files", "arguments": {}} oops</tool_call>',
        '<tool_call>\n{"name": "list_files", "arguments": {}} oops</tool_call>',
        [],
    ),
    # plain text is kept byte for byte, a lone "<" or partial tag included
    ("plain_text", "Hi! 2 < 3 and <tool is not a tag.  \n", "Hi! 2 < 3 and <tool is not a tag.  \n",
     []),
    ("partial_tag_at_end", "Look: <tool_ca", "Look: <tool_ca", []),
    ("smollm2_auto_plain", "Hello! How can I help you today?",
     "Hello! How can I help you today?", []),
]

LLAMA_CASES = [
    (
        "llama_single",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (
        "llama_python_tag_two_calls",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b{"}}; '
        '{"name": "list_files", "parameters": {}}',
        "",
        [("get_weather", {"city": "a;b{"}), ("list_files", {})],
    ),
    ("llama_plain_text", "  The weather is nice.", "  The weather is nice.", []),
    (
        "llama_malformed",
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        [],
    ),
    (
        "llama_not_a_call_object",
        '{"answer": 42}',
        '{"answer": 42}',
        [],
    ),
]


def _calls(message):
    return [(c.name, json.loads(c.arguments)) for c in message.tool_calls]


def _stream(parser, pieces):
    events = []
    for p in pieces:
        events += parser.push(p)
    events += parser.finish()
    return events


@pytest.mark.parametrize("name, text, content, calls", HERMES_CASES,
                         ids=[c[0] for c in HERMES_CASES])
def test_hermes_recorded_outputs(name, text, content, calls):
    message = HermesParser(TOOLS).parse(text)
    assert message.content == content
    assert _calls(message) == calls
    for call in message.tool_calls:
        assert call.id.startswith("call_") and "<tool_call>" not in call.arguments


@pytest.mark.parametrize("name, text, content, calls", LLAMA_CASES,
                         ids=[c[0] for c in LLAMA_CASES])
def test_llama3_json_recorded_outputs(name, text, content, calls):
    message = Llama3JsonParser(TOOLS).parse(text)
    assert message.content == content
    assert _calls(message) == calls


@pytest.mark.parametrize("parser_class, cases", [(HermesParser, HERMES_CASES),
                                                 (Llama3JsonParser, LLAMA_CASES)])
def test_stream_split_at_every_point_equals_whole(parser_class, cases):
    """api-tool-stream-indices: markup split across chunks anywhere gives the same result."""
    for _, text, content, calls in cases:
        whole = parser_class(TOOLS).parse(text)
        splits = [[text[:i], text[i:]] for i in range(len(text) + 1)]
        splits.append(list(text))  # one character per chunk
        for pieces in splits:
            got = collect(_stream(parser_class(TOOLS), pieces))
            assert got.content == whole.content == content, pieces
            assert _calls(got) == _calls(whole) == calls, pieces


def test_no_markup_leaks_into_streamed_content():
    text = HERMES_CASES[3][1]  # content then call
    parser = HermesParser(TOOLS)
    for ch in text:
        for ev in parser.push(ch):
            if isinstance(ev, ContentEvent):
                assert "<" not in ev.text
    parser.finish()


def test_stream_events_indices_and_order():
    text = HERMES_CASES[2][1]  # two calls
    events = _stream(HermesParser(TOOLS), [text[:30], text[30:90], text[90:]])
    calls = [e for e in events if isinstance(e, ToolCallEvent)]
    assert [e.index for e in calls] == [0, 1]
    assert len({e.call.id for e in calls}) == 2
    assert [e.call.arguments for e in calls] == ['{"city": "Paris"}', "{}"]


def test_max_calls_drops_later_calls():
    message = HermesParser(TOOLS, max_calls=1).parse(HERMES_CASES[2][1])
    assert _calls(message) == [("get_weather", {"city": "Paris"})]
    assert message.content == ""


def test_any_tool_name_when_names_unknown():
    message = HermesParser(None).parse(HERMES_CASES[13][1])
    assert _calls(message) == [("launch_rockets", {})]


def test_arguments_serialized_like_the_forcing_grammar():
    message = HermesParser(TOOLS).parse(
        '<tool_call>{"name":"search","arguments":{"q":"caf\u00e9","n":1}}</tool_call>')
    assert message.tool_calls[0].arguments == '{"q": "caf\u00e9", "n": 1}'


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_render_calls_round_trip(fmt):
    f = FORMATS[fmt]
    calls = [("get_weather", '{"city": "Paris"}'), ("run_shell", '{"command": "ls {a,b}"}')]
    message = f.parser(TOOLS).parse(f.render_calls(calls))
    assert [(c.name, c.arguments) for c in message.tool_calls] == calls
    assert message.content == ""


def test_detect_format_from_template():
    assert detect_format("{% for m in messages %}<tool_call>{% endfor %}") == "hermes"
    assert detect_format("{{ '<|python_tag|>' }} ipython") == "llama3_json"
    assert detect_format("<|im_start|>{{ m['role'] }}") == "hermes"  # fallback format
    assert detect_format(None) == "hermes"
    assert get_format("auto", None).name == "hermes"
    with pytest.raises(ValueError, match="unknown tool parser"):
        get_format("mistral")


def test_push_after_finish_is_an_error():
    parser = HermesParser(TOOLS)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.push("x")


# --------------------------------------------------------------------------- strict (forced)

# SmolLM2 under tool_choice "required" with parallel_tool_calls at its default and
# max_tokens 48 (case api-tool-required-parallel-default): one complete call, then a second
# started and cut by the limit.
CUT_SECOND = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "get_weather", "')
CUT_FIRST = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
CLOSE_CUT = '<tool_call>\n{"name": "list_files", "arguments": {}}\n</tool'


@pytest.mark.parametrize("text, calls", [
    (CUT_SECOND, [("get_weather", {"city": "Paris"})]),
    (CUT_FIRST, []),
    (CLOSE_CUT, [("list_files", {})]),
    (CUT_SECOND[:CUT_SECOND.index("</tool_call>") + 13], [("get_weather", {"city": "Paris"})]),
], ids=["second_call_cut", "first_call_cut", "closing_tag_cut", "separator_only"])
def test_strict_parser_drops_the_unfinished_call_api_tool_required_parallel_default(
        text, calls):
    """A forced answer is calls only: what the limit cut is dropped, never content, streamed
    (split anywhere) or not."""
    whole = HermesParser(TOOLS, strict=True).parse(text)
    assert whole.content == "" and _calls(whole) == calls and whole.strict
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        parser = HermesParser(TOOLS, strict=True)
        events = _stream(parser, pieces)
        assert not [e for e in events if isinstance(e, ContentEvent)], pieces
        assert _calls(collect(events)) == calls, pieces


def test_strict_finish_reason_settles_a_cut_after_complete_calls():
    """Cut after a complete call: the answer ended with its calls ("stop", reported as
    tool_calls / tool_use); cut inside the only call: "length" stays; not strict: unchanged."""
    parser = HermesParser(TOOLS, strict=True)
    parser.push(CUT_SECOND)
    parser.finish()
    assert parser.num_calls == 1 and parser.finish_reason("length") == "stop"
    assert parser.dropped.strip().startswith("<tool_call>")
    assert HermesParser(TOOLS, strict=True).parse(CUT_FIRST).finish_reason("length") == "length"
    loose = HermesParser(TOOLS).parse(CUT_SECOND)
    assert loose.finish_reason("length") == "length" and loose.content.startswith("<tool_call>")


def test_strict_llama3_json_drops_the_unfinished_call():
    text = '{"name": "search", "parameters": {"q": "x"}}; {"name": "sea'
    message = Llama3JsonParser(TOOLS, strict=True).parse(text)
    assert _calls(message) == [("search", {"q": "x"})] and message.content == ""
    assert message.finish_reason("length") == "stop"
    pending = Llama3JsonParser(TOOLS, strict=True).parse('{"name": "search", "parameters": {}}')
    assert _calls(pending) == [("search", {})]
