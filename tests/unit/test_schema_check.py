"""Satisfiability of JSON schemas (case api-unsatisfiable-schema): a schema whose only
values are infinite is refused before admission; recursive schemas with a base case pass."""

from __future__ import annotations

import pytest

from flare.server.api_error import ApiError
from flare.server.schema_check import (
    UnsatisfiableSchema,
    check_request_schemas,
    check_satisfiable,
)

# the three inputs of issue 23
REQUIRED_SELF = {"$ref": "#/$defs/n", "$defs": {"n": {
    "type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}}}
ROOT_SELF = {"$ref": "#"}
MUTUAL = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"},
                                         "b": {"$ref": "#/$defs/a"}}}

UNSATISFIABLE = {
    "required property of its own type": REQUIRED_SELF,
    "$ref to the root": ROOT_SELF,
    "mutual loop a -> b -> a": MUTUAL,
    "false": False,
    "every alternative loops": {"$defs": {"n": {"anyOf": [{"$ref": "#/$defs/n"},
                                                          {"allOf": [{"$ref": "#/$defs/n"}]}]}},
                                "$ref": "#/$defs/n"},
    "a non-empty array of itself": {"type": "array", "items": {"$ref": "#"}, "minItems": 1},
    "a loop through a forced tuple item": {
        "type": "object", "required": ["p"],
        "properties": {"p": {"type": "array", "minItems": 1, "prefixItems": [{"$ref": "#"}]}}},
    "an escaped pointer": {"$ref": "#/$defs/a~1b", "$defs": {"a/b": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/a~1b"}}, "required": ["x"]}}},
}

SATISFIABLE = {
    "plain object": {"type": "object"},
    "empty schema": {},
    "optional recursion (linked list)": {"$ref": "#/$defs/n", "$defs": {"n": {
        "type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}},
    "nullable recursion": {"$ref": "#/$defs/n", "$defs": {"n": {
        "type": "object", "required": ["next"],
        "properties": {"next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}}}}},
    "tree with a possibly empty child list": {
        "type": "object", "required": ["kids"],
        "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}},
    "a type list with a base case": {"type": ["object", "null"], "required": ["x"],
                                     "properties": {"x": {"$ref": "#"}}},
    "mutual recursion with a way out": {"$ref": "#/$defs/a", "$defs": {
        "a": {"anyOf": [{"$ref": "#/$defs/b"}, {"type": "string"}]},
        "b": {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#/$defs/a"}}}}},
    "a reference to another document (left to the library)": {"$ref": "https://x/y.json"},
    "a reference to an anchor (left to the library)": {"$ref": "#node"},
}


@pytest.mark.parametrize("schema", UNSATISFIABLE.values(), ids=UNSATISFIABLE.keys())
def test_schemas_whose_only_values_are_infinite_are_refused(schema):
    with pytest.raises(UnsatisfiableSchema):
        check_satisfiable(schema)


@pytest.mark.parametrize("schema", SATISFIABLE.values(), ids=SATISFIABLE.keys())
def test_schemas_with_a_finite_value_pass(schema):
    check_satisfiable(schema)


def test_a_long_chain_of_references_is_resolved():
    """Round after round: d0 -> d1 -> ... -> d199 -> string."""
    defs = {f"d{i}": {"type": "object", "required": ["x"],
                      "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(199)}
    defs["d199"] = {"type": "string"}
    check_satisfiable({"$ref": "#/$defs/d0", "$defs": defs})
    defs["d199"] = {"$ref": "#/$defs/d0"}
    with pytest.raises(UnsatisfiableSchema):
        check_satisfiable({"$ref": "#/$defs/d0", "$defs": defs})


def test_request_schemas_name_the_field_and_the_tool():
    with pytest.raises(ApiError) as e:
        check_request_schemas([("ok", {"type": "object"}), ("loop", REQUIRED_SELF)], None)
    assert e.value.status_code == 400
    body = e.value.body()["error"]
    assert body["code"] == "unsupported_schema"
    assert body["param"] == "tools[1].function.parameters"
    assert "'loop'" in body["message"] and "#/$defs/n" in body["message"]
    with pytest.raises(ApiError) as e:
        check_request_schemas([("t", None, True)], ROOT_SELF)
    assert e.value.body()["error"]["param"] == "response_format"
    check_request_schemas([("t", None)], {"type": "object"})
