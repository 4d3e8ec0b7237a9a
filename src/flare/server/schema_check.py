"""Satisfiability of a JSON schema: does a finite JSON value valid for it exist?

A grammar built from a schema whose only values are infinite (case
api-unsatisfiable-schema: `{"$ref": "#"}`, a mutual loop `a -> b -> a`, an object that
requires a property of its own type) cannot be completed: constrained decoding would run
until the constraint library gives up and the answer is cut. Such a schema is refused
before admission with 400 `unsupported_schema` (`check_satisfiable`), on every surface that
takes one (chat `response_format` and `tools`, Anthropic `tools[].input_schema`, Responses
`text.format` and `tools`); the check runs in the shared generation core.

The test is a least fixed point over the schema's `$ref` targets: a subschema has a finite
value when, with every `$ref` read as "its target is already known to have one", its
keywords can be met by a finite value: `false` never; `allOf` when every part can;
`anyOf` / `oneOf` when one part can; an object when every required property's schema can;
an array when `minItems` > 0 or `prefixItems` forces items whose schemas can (`items`,
`prefixItems`); every other keyword (types, enums, strings, numbers) always can. Targets
start as "unknown" and become "known" round by round until nothing changes; a target never
proven is reachable only through infinite values. The rules over-approximate (they do not
check that `allOf` parts agree, or that `enum` values match their siblings): a schema that
passes may still be unsatisfiable for other reasons, which the constraint library reports
itself. A `$ref` this module cannot resolve (another document, an `$anchor`) counts as
satisfiable, for the library to judge.

JSON pointers follow RFC 6901 (`~1` is `/`, `~0` is `~`, percent-escapes decoded).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote

from flare.server.api_error import ApiError

MAX_ROUNDS = 10_000  # far above any real schema's reference depth; bounds a hostile one


class UnsatisfiableSchema(ValueError):
    """No finite JSON value is valid for the schema; the message names where it loops."""


def _resolve(root: Any, ref: str) -> Any:
    """The subschema `ref` ("#", "#/$defs/a", ...) points at, or None when unresolvable."""
    if not ref.startswith("#"):
        return None
    pointer = unquote(ref[1:])
    if pointer == "":
        return root
    if not pointer.startswith("/"):
        return None  # an anchor ("#node"): left to the constraint library
    node = root
    for token in pointer[1:].split("/"):
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def _refs(node: Any, out: set[str], depth: int = 0) -> None:
    """Every `$ref` string in `node` (any depth; schemas nest far less than 1,000)."""
    if depth > 1000:
        return
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            out.add(ref)
        for value in node.values():
            _refs(value, out, depth + 1)
    elif isinstance(node, list):
        for value in node:
            _refs(value, out, depth + 1)


def _finite(node: Any, known: dict[str, bool], depth: int = 0) -> bool:
    """Whether `node` has a finite value, reading each `$ref` from `known` (module
    docstring); unresolvable refs are in `known` as True."""
    if node is False:
        return False
    if not isinstance(node, dict) or depth > 1000:
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and not known.get(ref, False):
        return False
    all_of = node.get("allOf")
    if isinstance(all_of, list) and not all(_finite(s, known, depth + 1) for s in all_of):
        return False
    for key in ("anyOf", "oneOf"):
        alts = node.get(key)
        if isinstance(alts, list) and alts and not any(_finite(s, known, depth + 1)
                                                       for s in alts):
            return False
    types = node.get("type")
    type_list = types if isinstance(types, list) else [types] if isinstance(types, str) else []
    # no type: the object and array keywords constrain only objects and arrays, and any
    # other value (a number) is finite
    return not type_list or any(_type_finite(t, node, known, depth) for t in type_list)


def _type_finite(kind: str, node: dict[str, Any], known: dict[str, bool], depth: int) -> bool:
    if kind == "object":
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        return all(_finite(props[name], known, depth + 1)
                   for name in required if isinstance(name, str) and name in props)
    if kind == "array":
        min_items = node.get("minItems", 0)
        min_items = min_items if isinstance(min_items, int) else 0
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        forced_prefix = prefix[:min_items]
        if not all(_finite(s, known, depth + 1) for s in forced_prefix):
            return False
        if min_items > len(prefix) and "items" in node:
            return _finite(node["items"], known, depth + 1)
        return True
    return True


def check_satisfiable(schema: Any, where: str = "schema") -> None:
    """Refuse a schema with no finite valid value (module docstring).

    Args:
        schema: a JSON schema (dict or bool); anything else is left to the caller's
            validation.
        where: the request field it came from, for the message.

    Raises:
        UnsatisfiableSchema: every value the schema allows is infinite (a `$ref` loop
            that a required property or a forced array item must follow forever).
    """
    if not isinstance(schema, (dict, bool)):
        return
    refs: set[str] = set()
    _refs(schema, refs)
    targets = {ref: _resolve(schema, ref) for ref in refs}
    # unresolvable references are the constraint library's to judge: assumed satisfiable
    known = {ref: target is None for ref, target in targets.items()}
    for _ in range(MAX_ROUNDS):
        changed = False
        for ref, target in targets.items():
            if not known[ref] and _finite(target, known):
                known[ref] = changed = True
        if not changed:
            break
    if _finite(schema, known):
        return
    loops = sorted(ref for ref, ok in known.items() if not ok)
    if not loops:
        raise UnsatisfiableSchema(f"{where} allows no JSON value at all.")
    raise UnsatisfiableSchema(
        f"{where} cannot be satisfied by any finite JSON value (through $ref "
        f"{', '.join(loops[:3])}): every value it allows nests forever, so no answer could "
        "ever complete it; make the recursive property optional or give the recursion a "
        "base case.")


def check_request_schemas(specs: Sequence[Sequence[Any]], answer: Any = None) -> None:
    """Refuse a request whose tool argument schemas or answer schema have no finite value.

    Args:
        specs: per tool, in request order, a sequence whose first two items are the tool's
            name and its parameters schema (None: no parameters); as the generation core
            takes them.
        answer: the answer's JSON schema (response_format, text.format), or None.

    Raises:
        ApiError: 400 `unsupported_schema`, `param` named as the chat request names it
            (`tools[i].function.parameters`, `response_format`; surfaces rename it).
    """
    checks = [(spec[1], f"tools[{i}].function.parameters", f"the parameters schema of "
               f"tool {spec[0]!r}") for i, spec in enumerate(specs)]
    checks.append((answer, "response_format", "the response format's schema"))
    for schema, param, where in checks:
        if schema is None:
            continue
        try:
            check_satisfiable(schema, where)
        except UnsatisfiableSchema as e:
            raise ApiError(400, str(e), param=param, code="unsupported_schema") from None
