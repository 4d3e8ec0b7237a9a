"""Constrained decoding with llguidance: grammars for forced tool calls and JSON output.

A request that needs guaranteed structure (`tool_choice` required or a named function,
`response_format` json_object or json_schema) gets one `GrammarConstraint` per choice: the
engine asks it for the allowed-token mask before each sampling of that row, masks the
logits, and advances it with the sampled token; when the grammar is complete (nothing but
end-of-sequence may follow) the request finishes with "stop".

Why llguidance (docs/agents.md has the measurements): a 3 MB wheel with no dependencies
(xgrammar pulls triton and a TVM runtime; outlines-core compiles a regex index per schema,
12 s for "any JSON object"), masks computed lazily by an Earley parser over a token trie
(about 25 us median per token for a 49,152-token vocabulary here), Lark grammars with
embedded JSON schemas (`%json {...}`), which is exactly "tool-call markup around arguments
valid for a schema", and it is the engine behind the structured outputs of llama.cpp,
vLLM and SGLang.

JSON is written without optional whitespace, with `", "` and `": "` separators (the form
`json.dumps` writes): a small model cannot wander into endless whitespace, and a tool call
re-rendered in a later prompt has the same text the model produced.
"""

from __future__ import annotations

import copy
import json
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flare.server.tool_formats import ToolFormat

log = logging.getLogger(__name__)

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Most calls a forced answer may hold: a small model that never chooses to stop after a
# call would otherwise repeat calls until max_tokens.
MAX_FORCED_CALLS = 8
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


class GrammarError(ValueError):
    """A grammar (schema) the constraint library cannot build; `param` names the request
    field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


# --------------------------------------------------------------------------- grammars


def _lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule body matching JSON valid for `schema` (Flare's JSON_OPTIONS)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


# keywords that already say what an object may hold beyond its `properties`
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# keywords that may add properties from elsewhere: `additionalProperties: false` beside
# them would refuse those (JSON Schema applies it to the sibling `properties` only)
_COMBINING = ("allOf", "anyOf", "oneOf", "$ref", "if", "dependentSchemas")
# keywords whose value is one subschema, a list of them, or a map of names to them
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else",
              "additionalProperties", "propertyNames", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")


def strict_schema(schema: Any, *, top: bool = True) -> Any:
    """`schema` as strict mode enforces it (OpenAI's function `strict`, Flare's default):
    every object schema that lists its `properties` (and the top-level one, always) gets
    `"additionalProperties": false` unless it says itself what else it allows
    (`additionalProperties`, `patternProperties`, `unevaluatedProperties`) or takes
    properties from a combination (`allOf`, `anyOf`, `oneOf`, `$ref`, ...) or requires a
    property it does not list (closing it would leave no valid value); `required` is kept
    as given and enforced by the grammar. Subschemas (properties, items, anyOf,
    $defs, ...) are made strict the same way. A nested `{"type": "object"}` without
    `properties` stays a free-form object.

    Returns:
        A new schema; `schema` is not modified. A value that is not a dict (a boolean
        schema) is returned as it is.
    """
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key], top=False)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s, top=False) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(s, top=False) for k, s in out[key].items()}
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        kind is None and "properties" in out)
    listed = out.get("properties") if isinstance(out.get("properties"), dict) else {}
    required = out.get("required") if isinstance(out.get("required"), list) else []
    if (is_object and (top or "properties" in out)
            and not any(k in out for k in _OPEN_KEYWORDS + _COMBINING)
            and all(name in listed for name in required)):
        out["additionalProperties"] = False
    return out


def parameters_schema(parameters: dict[str, Any] | None, strict: bool = True
                      ) -> dict[str, Any]:
    """A tool's argument schema as the grammar enforces it.

    Args:
        parameters: the tool's JSON Schema of an object (None or `{}`: no parameters).
        strict: strict mode (`strict_schema`: no property the schema does not list); False
            only where the request opts out (OpenAI's `"strict": false`).

    Returns:
        A schema of an object: `{}` is the only value when the tool declares no
        parameters (`None`, `{}` or `{"type": "object", "properties": {}}` in strict mode).
    """
    if not parameters:
        return dict(EMPTY_PARAMETERS)
    if "type" not in parameters:
        parameters = {**parameters, "type": "object"}
    return strict_schema(parameters) if strict else parameters


@dataclass(frozen=True)
class GrammarPart:
    """One piece of a grammar, with the request field it comes from (for errors)."""

    lark: str
    param: str


ToolSpec = tuple[str, dict[str, Any] | None] | tuple[str, dict[str, Any] | None, bool]


def tool_call_grammar(fmt: ToolFormat, tools: Sequence[ToolSpec],
                      *, only: str | None = None, parallel: bool = True,
                      answer_schema: dict[str, Any] | None = None) -> tuple[str, list[GrammarPart]]:
    """Lark grammar of one or more tool calls in `fmt`'s markup.

    Args:
        fmt: the model's tool-call format.
        tools: (name, parameters schema or None[, strict]) per tool, in request order;
            strict (default True) is `parameters_schema`'s.
        only: force exactly one call of this tool (a named tool_choice); otherwise calls
            of any of `tools`.
        parallel: allow several calls (separated as the format does), at most
            MAX_FORCED_CALLS; ignored with `only`.
        answer_schema: also allow a JSON answer valid for this schema instead of calls
            (tool_choice auto with a response_format).

    Returns:
        (grammar text, its parts): the parts let a failure be traced to one field.
    """
    rules, parts, alts = [], [], []
    for i, (name, params, *strict) in enumerate(tools):
        if only is not None and name != only:
            continue
        args = _lark_json(parameters_schema(params, strict[0] if strict else True))
        parts.append(GrammarPart(f"start: {args}", f"tools[{i}].function.parameters"))
        rules += [f"args_{i}: {args}", f"call_{i}: {fmt.call_grammar(name, f'args_{i}')}"]
        alts.append(f"call_{i}")
    calls = "call"
    if parallel and only is None:
        calls = f"call ({json.dumps(fmt.separator)} call){{0,{MAX_FORCED_CALLS - 1}}}"
    start = f"start: {calls}"
    if answer_schema is not None:
        answer = _lark_json(answer_schema)
        parts.append(GrammarPart(f"start: {answer}", "response_format"))
        rules.append(f"answer: {answer}")
        start = f"start: answer | {calls}"
    return "\n".join([start, "call: " + " | ".join(alts), *rules]), parts


def json_grammar(schema: dict[str, Any] | None) -> tuple[str, list[GrammarPart]]:
    """Lark grammar of one JSON value valid for `schema` (None: any JSON object)."""
    text = f"start: {_lark_json(schema if schema is not None else {'type': 'object'})}"
    return text, [GrammarPart(text, "response_format")]


# --------------------------------------------------------------------------- constraints


class GrammarConstraint:
    """`flare.runtime.request.TokenConstraint` over an llguidance matcher (one request).

    Called only from the engine thread after it is handed over, inside the engine's step:
    no method raises, since an exception there would fail every request of the step. If the
    matcher fails (a token it did not allow, a resource limit, an internal error), only
    end-of-sequence is allowed from then on and `is_done()` is True, so this request ends
    at once instead of producing garbage; the others are untouched.
    """

    def __init__(self, matcher: Any, n_vocab: int, eos_token_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._eos = list(eos_token_ids)
        self._words = torch.zeros((n_vocab + 31) // 32, dtype=torch.int32)  # 1 bit per token
        self._failed: str | None = None

    def _fail(self, why: str) -> None:
        if self._failed is None:
            self._failed = why
            log.warning("grammar constraint failed: %s", why)

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """Bool mask [vocab_size]: tokens the grammar allows next (ids past the tokenizer's
        vocabulary, e.g. padding rows of the output layer, are never allowed)."""
        try:
            if self._failed is None and not self._matcher.is_error():
                self._matcher.unsafe_compute_mask_ptr(self._words.data_ptr(),
                                                      self._words.numel() * 4)
                # little-endian u32 words: byte-wise little bit order is token order
                bits = np.unpackbits(self._words.numpy().view(np.uint8), bitorder="little")
                mask = torch.from_numpy(bits.view(np.bool_))
                if mask.numel() >= vocab_size:
                    return mask[:vocab_size]
                return torch.cat([mask, torch.zeros(vocab_size - mask.numel(),
                                                    dtype=torch.bool)])
            self._fail(self._matcher.get_error() or "matcher in error state")
        except Exception as e:  # noqa: BLE001 - see the class docstring
            self._fail(f"mask computation raised {e!r}")
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[[t for t in self._eos if t < vocab_size]] = True
        return mask

    def advance(self, token_id: int) -> None:
        try:
            if self._failed is None and not self._matcher.consume_token(token_id):
                self._fail(f"token {token_id} refused: {self._matcher.get_error()}")
        except Exception as e:  # noqa: BLE001
            self._fail(f"advance raised {e!r}")

    def is_done(self) -> bool:
        try:
            return self._failed is not None or self._matcher.is_stopped()
        except Exception as e:  # noqa: BLE001
            self._fail(f"is_stopped raised {e!r}")
            return True

    @property
    def error(self) -> str | None:
        """Why the constraint gave up, or None."""
        return self._failed


class GrammarCompiler:
    """Compiles grammars for one tokenizer; the llguidance tokenizer (about 1 s to build)
    is made once, on first use, and shared.

    Args:
        tokenizer: a transformers fast tokenizer.
        eos_token_ids: tokens that end a sequence (allowed when the grammar is complete).
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._eos = sorted(set(eos_token_ids) | ({tokenizer.eos_token_id}
                                                 if getattr(tokenizer, "eos_token_id", None)
                                                 is not None else set()))
        self._ll: Any = None
        self._lock = threading.Lock()

    def ll_tokenizer(self) -> Any:
        """The shared `llguidance.LLTokenizer` (built on first call; thread-safe).

        Raises:
            GrammarError: the tokenizer is not a fast (Rust) one.
        """
        with self._lock:
            if self._ll is None:
                import llguidance

                backend = getattr(self._tokenizer, "backend_tokenizer", None)
                if backend is None or not self._eos:
                    raise GrammarError("constrained decoding needs a fast tokenizer with an "
                                       "end-of-sequence token; this model has none")
                spec = json.loads(backend.to_str())  # read-only: the server encodes with it
                spec["padding"] = spec["truncation"] = None
                self._ll = llguidance.LLTokenizer(json.dumps(spec), n_vocab=len(self._tokenizer),
                                                  eos_token=self._eos)
            return self._ll

    def compile(self, grammar: str, parts: Sequence[GrammarPart] = ()) -> GrammarConstraint:
        """A fresh constraint for `grammar` (Lark text); CPU-heavy for big schemas, so call
        it off the event loop.

        Raises:
            GrammarError: the grammar does not compile; `param` names the first part that
                fails alone, when one does.
        """
        import llguidance

        ll = self.ll_tokenizer()
        matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar),
                                       log_level=0)
        if matcher.is_error():
            error, param = matcher.get_error(), None
            for part in parts:
                m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(part.lark),
                                         log_level=0)
                if m.is_error():
                    error, param = m.get_error(), part.param
                    break
            raise GrammarError(f"cannot enforce this schema: {_short(error)}", param)
        return GrammarConstraint(matcher, len(self._tokenizer), self._eos)

    def copies(self, constraint: GrammarConstraint, n: int) -> list[GrammarConstraint]:
        """`n` independent constraints in the state of `constraint` (one per choice)."""
        out = [constraint]
        for _ in range(n - 1):
            c = copy.copy(constraint)
            c._matcher = constraint._matcher.deep_copy()
            c._words = torch.zeros_like(constraint._words)
            out.append(c)
        return out


def grammar_failure_message(constraint: Any) -> str:
    """What a client is told when `constraint` gave up mid-generation (the engine's finish
    reason "grammar_error"): the library's reason, shortened, and what to do about it. The
    surfaces without a finish reason for it report it with this message: Anthropic as an
    `invalid_request_error`, Responses as a `failed` response with error code
    "grammar_error"."""
    why = getattr(constraint, "error", None) or "unknown error"
    return (f"grammar_error: the constraint on this answer's structure failed mid-generation "
            f"({_short(why)}); the answer was cut there. Simplify the schema and retry.")


def _short(error: str, limit: int = 300) -> str:
    """llguidance's message without its location prefix and grammar echo lines."""
    lines = [ln for ln in error.strip().splitlines() if not re.match(r"^\s*\d*\s*\|", ln)]
    text = re.sub(r"^at \d+\(\d+\):\s*", "", " ".join(" ".join(lines).split()))
    text = text or "unknown error"
    return text if len(text) <= limit else text[:limit] + "..."
