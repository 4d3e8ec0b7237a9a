"""Forcing grammars (llguidance) over the embedded model's real tokenizer.

Case api-tool-choice-modes: "required" or a named function always yields a call with
arguments valid for the schema; here the grammar itself is checked token by token (the
end-to-end run on the model is in tests/integration/test_agent_api.py).
"""

from __future__ import annotations

import json

import pytest
import torch

from flare.server.grammar import (
    MAX_FORCED_CALLS,
    GrammarCompiler,
    GrammarError,
    json_grammar,
    parameters_schema,
    strict_schema,
    tool_call_grammar,
)
from flare.server.tool_formats import FORMATS

VOCAB = 49152
EOS = 2

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string"},
                          "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [("get_weather", WEATHER), ("list_files", None)]


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, [EOS])


def _walk(constraint, tokenizer, text):
    """Feed `text`'s tokens through the constraint as the engine would; returns the index
    of the first token the grammar refuses, or None when all were allowed."""
    for i, tok in enumerate(tokenizer.encode(text, add_special_tokens=False)):
        mask = constraint.allowed(VOCAB)
        assert mask.shape == (VOCAB,) and mask.dtype == torch.bool
        if not mask[tok]:
            return i
        constraint.advance(tok)
    return None


def test_named_tool_call_accepts_schema_valid_call_then_stops(compiler, tokenizer):
    c = compiler.compile(*tool_call_grammar(FORMATS["hermes"], TOOLS, only="get_weather"))
    text = FORMATS["hermes"].call_text("get_weather", '{"city": "Paris", "unit": "celsius"}')
    assert _walk(c, tokenizer, text) is None
    assert c.is_done()
    mask = c.allowed(VOCAB)
    assert mask.sum() == 1 and mask[EOS]  # nothing but end-of-sequence


@pytest.mark.parametrize("arguments", [
    '{"city": "Paris", "unit": "kelvin"}',   # not in the enum
    '{"city": "Paris"}',                     # missing a required property
    '{"city": 3, "unit": "celsius"}',        # wrong type
    '{"city":"Paris","unit":"celsius"}',     # Flare's JSON has ", " and ": " separators
])
def test_named_tool_call_refuses_invalid_arguments(compiler, tokenizer, arguments):
    c = compiler.compile(*tool_call_grammar(FORMATS["hermes"], TOOLS, only="get_weather"))
    assert _walk(c, tokenizer, FORMATS["hermes"].call_text("get_weather", arguments)) is not None


def test_named_tool_forbids_other_tools_and_plain_text(compiler, tokenizer):
    grammar = tool_call_grammar(FORMATS["hermes"], TOOLS, only="get_weather")
    c = compiler.compile(*grammar)
    assert _walk(c, tokenizer, FORMATS["hermes"].call_text("list_files", "{}")) is not None
    c = compiler.compile(*grammar)
    assert _walk(c, tokenizer, "Hello there") == 0


@pytest.mark.parametrize("format_name, calls", [
    ("hermes", [("list_files", "{}"),
                ("get_weather", '{"city": "Oslo", "unit": "fahrenheit"}')]),
    ("llama3_json", [("get_weather", '{"city": "Rome", "unit": "celsius"}'),
                     ("list_files", "{}")]),
])
def test_required_allows_any_tool_and_several_calls(compiler, tokenizer, format_name, calls):
    fmt = FORMATS[format_name]
    c = compiler.compile(*tool_call_grammar(fmt, TOOLS))
    assert _walk(c, tokenizer, fmt.render_calls(calls)) is None
    assert not c.is_done() and c.allowed(VOCAB)[EOS]  # may stop, or call again


def test_required_caps_the_number_of_calls(compiler, tokenizer):
    fmt = FORMATS["hermes"]
    c = compiler.compile(*tool_call_grammar(fmt, TOOLS))
    assert _walk(c, tokenizer, fmt.render_calls([("list_files", "{}")] * MAX_FORCED_CALLS)) is None
    assert c.is_done()


def test_parallel_false_is_one_call(compiler, tokenizer):
    fmt = FORMATS["hermes"]
    c = compiler.compile(*tool_call_grammar(fmt, TOOLS, parallel=False))
    assert _walk(c, tokenizer, fmt.call_text("list_files", "{}")) is None
    assert c.is_done()


def test_tool_without_parameters_gets_empty_object(compiler, tokenizer):
    fmt = FORMATS["hermes"]
    c = compiler.compile(*tool_call_grammar(fmt, TOOLS, only="list_files"))
    assert _walk(c, tokenizer, fmt.call_text("list_files", '{"x": 1}')) is not None


def test_auto_with_response_format_allows_answer_or_call(compiler, tokenizer):
    fmt = FORMATS["hermes"]
    grammar = tool_call_grammar(fmt, TOOLS, answer_schema={"type": "object"})
    c = compiler.compile(*grammar)
    assert _walk(c, tokenizer, '{"answer": [1, 2]}') is None and c.is_done()
    c = compiler.compile(*grammar)
    assert _walk(c, tokenizer, fmt.call_text("list_files", "{}")) is None


NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "address": {"type": "object", "properties": {"zip": {"type": "integer"}},
                    "required": ["zip"]},
    },
    "required": ["name", "tags", "address"],
}


def test_json_schema_grammar(compiler, tokenizer):
    good = json.dumps({"name": "x {y}", "tags": ["a", "b"], "address": {"zip": 7}})
    c = compiler.compile(*json_grammar(NESTED))
    assert _walk(c, tokenizer, good) is None and c.is_done()
    bad = json.dumps({"name": "x", "tags": ["a", "b", "a"], "address": {"zip": 7}})
    assert _walk(compiler.compile(*json_grammar(NESTED)), tokenizer, bad) is not None


def test_json_object_grammar_any_object_only(compiler, tokenizer):
    c = compiler.compile(*json_grammar(None))
    assert _walk(c, tokenizer, '{"a": {"b": [true, null, "}"]}}') is None and c.is_done()
    assert _walk(compiler.compile(*json_grammar(None)), tokenizer, "[1]") == 0


@pytest.mark.parametrize("schema, words", [
    ({"not": {"type": "string"}}, "Unimplemented keys"),
    ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
])
def test_unenforceable_schema_names_the_field(compiler, schema, words):
    with pytest.raises(GrammarError) as exc:
        compiler.compile(*json_grammar(schema))
    assert exc.value.param == "response_format" and words in str(exc.value)
    tools = [("get_weather", WEATHER), ("bad", {"type": "object", "properties": {"x": schema}})]
    with pytest.raises(GrammarError) as exc:
        compiler.compile(*tool_call_grammar(FORMATS["hermes"], tools))
    assert exc.value.param == "tools[1].function.parameters"


def test_refused_token_ends_the_request(compiler, tokenizer):
    c = compiler.compile(*json_grammar(None))
    c.advance(tokenizer.encode("hello", add_special_tokens=False)[0])  # not allowed
    assert c.is_done()
    mask = c.allowed(VOCAB)
    assert mask.sum() == 1 and mask[EOS]


def test_copies_are_independent(compiler, tokenizer):
    a, b = compiler.copies(compiler.compile(*json_grammar(None)), 2)
    assert _walk(a, tokenizer, "{}") is None and a.is_done()
    assert not b.is_done() and not b.allowed(VOCAB)[EOS]


def test_mask_is_padded_to_the_logits_width(compiler):
    c = compiler.compile(*json_grammar(None))
    mask = c.allowed(VOCAB + 64)
    assert mask.shape == (VOCAB + 64,) and not mask[VOCAB:].any()


def test_matcher_exceptions_never_escape_into_the_engine_step(compiler):
    class Exploding:
        def __getattr__(self, name):
            def boom(*a, **k):
                raise RuntimeError("internal")
            return boom

    c = compiler.compile(*json_grammar(None))
    c._matcher = Exploding()
    mask = c.allowed(VOCAB)
    assert mask.sum() == 1 and mask[EOS]
    c.advance(5)
    assert c.is_done() and "internal" in c.error


# --------------------------------------------------------------------------- strict mode

NO_PARAMS = {"type": "object", "properties": {}}


def test_no_parameter_tool_takes_only_empty_arguments_api_tool_no_params(compiler, tokenizer):
    """Case api-tool-no-params: `{"type": "object", "properties": {}}` with a named
    tool_choice: `{}` is the only argument object (no invented keys such as `{":": true}`,
    no echo of the schema)."""
    fmt = FORMATS["hermes"]
    grammar = tool_call_grammar(fmt, [("current_time", NO_PARAMS)], only="current_time")
    assert _walk(compiler.compile(*grammar), tokenizer, fmt.call_text("current_time", "{}")) \
        is None
    for bad in ['{":": true}', '{"type": "object"}', '{"time": "now"}']:
        assert _walk(compiler.compile(*grammar), tokenizer,
                     fmt.call_text("current_time", bad)) is not None, bad


def test_strict_refuses_unlisted_properties_and_enforces_required(compiler, tokenizer):
    fmt = FORMATS["hermes"]
    open_weather = {k: v for k, v in WEATHER.items() if k != "additionalProperties"}
    grammar = tool_call_grammar(fmt, [("get_weather", open_weather)], only="get_weather")

    def ok(arguments, g=grammar):
        return _walk(compiler.compile(*g), tokenizer,
                     fmt.call_text("get_weather", arguments)) is None

    assert ok('{"city": "Oslo", "unit": "celsius"}')
    assert not ok('{"city": "Oslo", "unit": "celsius", "extra": 1}')
    assert not ok('{"city": "Oslo"}')  # required
    loose = tool_call_grammar(fmt, [("get_weather", open_weather, False)], only="get_weather")
    assert ok('{"city": "Oslo", "unit": "celsius", "extra": 1}', loose)  # strict: false


@pytest.mark.parametrize("schema, strict", [
    (None, {"type": "object", "properties": {}, "additionalProperties": False}),
    ({}, {"type": "object", "properties": {}, "additionalProperties": False}),
    ({"type": "object"}, {"type": "object", "additionalProperties": False}),
    ({"properties": {"a": {"type": "string"}}},
     {"properties": {"a": {"type": "string"}}, "type": "object", "additionalProperties": False}),
    ({"type": "object", "properties": {"o": {"type": "object", "properties": {}}}},
     {"type": "object", "additionalProperties": False,
      "properties": {"o": {"type": "object", "properties": {}, "additionalProperties": False}}}),
    # nested free-form object: kept open
    ({"type": "object", "properties": {"env": {"type": "object"}}},
     {"type": "object", "additionalProperties": False,
      "properties": {"env": {"type": "object"}}}),
    # arrays of objects, $defs, anyOf branches
    ({"type": "object", "properties": {"xs": {"type": "array", "items": {
        "type": "object", "properties": {"k": {"type": "integer"}}}}},
      "$defs": {"p": {"type": "object", "properties": {"q": {}}}},
      "anyOf": [{"type": "object", "properties": {"z": {}}}]},
     {"type": "object", "properties": {"xs": {"type": "array", "items": {
         "type": "object", "properties": {"k": {"type": "integer"}},
         "additionalProperties": False}}},
      "$defs": {"p": {"type": "object", "properties": {"q": {}}, "additionalProperties": False}},
      "anyOf": [{"type": "object", "properties": {"z": {}}, "additionalProperties": False}]}),
    # what the schema says itself is kept
    ({"type": "object", "properties": {}, "additionalProperties": {"type": "string"}},
     {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}}),
    ({"type": "object", "patternProperties": {"^x": {}}},
     {"type": "object", "patternProperties": {"^x": {}}}),
    # properties that come from a combination are not shut out
    ({"type": "object", "allOf": [{"properties": {"a": {}}}]},
     {"type": "object", "allOf": [{"properties": {"a": {}}, "additionalProperties": False}]}),
    # a required property it does not list: closing it would leave no valid value
    ({"type": "object", "properties": {"a": {}}, "required": ["b"]},
     {"type": "object", "properties": {"a": {}}, "required": ["b"]}),
], ids=["none", "empty", "bare_object", "untyped", "nested", "free_form", "deep",
        "additional_schema", "pattern", "all_of", "required_unlisted"])
def test_strict_schema_table(schema, strict):
    before = json.dumps(schema)
    assert parameters_schema(schema) == strict
    assert json.dumps(schema) == before  # the request's schema is not modified
    if schema:
        assert parameters_schema(schema, strict=False) == {"type": "object", **schema}


def test_strict_schema_leaves_non_objects_alone():
    assert strict_schema({"type": "string"}) == {"type": "string"}
    assert strict_schema(True) is True
