"""Tool-call formats: how each model family writes calls (`flare serve --tool-parser`).

A `ToolFormat` bundles, for one family: its streaming parser (`flare.server.tool_parsers`),
the text of a call as the model writes it (used to re-render earlier calls in a prompt),
the Lark expression of one call (used by the forcing grammar, `flare.server.grammar`), and
the system-prompt section of Flare's fallback for chat templates without tool support.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from flare.server.tool_calls import ToolCallParser
from flare.server.tool_parsers import HermesParser, Llama3JsonParser

TOOL_PARSERS = ("hermes", "llama3_json")


class ToolFormat:
    """How one model family writes tool calls: parser, fallback prompt, forcing grammar."""

    name = ""
    parser_class: type[ToolCallParser] = ToolCallParser
    separator = "\n"  # between two forced calls

    def parser(self, tool_names: Iterable[str] | None = None,
               max_calls: int | None = None, strict: bool = False) -> ToolCallParser:
        """A fresh parser of this format (`strict`: a forced answer, see
        `flare.server.tool_calls`)."""
        return self.parser_class(tool_names, max_calls, strict)

    # A call is `call_head(name)`, the arguments object, then `call_tail`: the text and the
    # forcing grammar are built from the same pieces, so a forced call re-renders exactly.
    call_tail = ""

    def call_head(self, name: str) -> str:
        """What precedes the arguments object in a call of `name`."""
        raise NotImplementedError

    def call_text(self, name: str, arguments: str) -> str:
        """One call as the model writes it (`arguments`: JSON object text)."""
        return self.call_head(name) + arguments + self.call_tail

    def call_grammar(self, name: str, args_rule: str) -> str:
        """A Lark expression for one call of `name` whose arguments match `args_rule`."""
        return f"{_lark_str(self.call_head(name))} {args_rule} {_lark_str(self.call_tail)}"

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """Calls (name, arguments text) of an earlier assistant turn, as the model wrote
        them; the forced grammar writes exactly this, so re-rendering keeps the tokens."""
        return self.separator.join(self.call_text(n, a) for n, a in calls)

    def system_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        """The fallback prompt's tool section: each tool's JSON, one a line, inside the
        format's instructions (`instructions`)."""
        return self.instructions("\n".join(json.dumps(t, ensure_ascii=False) for t in tools))

    def instructions(self, signatures: str) -> str:
        """How to call the tools whose `signatures` (JSON lines) it names."""
        raise NotImplementedError


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class HermesFormat(ToolFormat):
    name = "hermes"
    call_tail = "}\n</tool_call>"  # closes the call object, then the block
    parser_class = HermesParser

    def call_head(self, name: str) -> str:
        return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": '

    def instructions(self, signatures: str) -> str:
        return (
            "# Tools\n\n"
            "You can call functions to help with the user's request. Their signatures are "
            "inside <tools></tools> tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "To call a function, answer with one block per call, a JSON object with the "
            "function's name and its arguments inside <tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments>}}\n'
            "</tool_call>\n"
            "Results come back inside <tool_response></tool_response> tags."
        )


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    parser_class = Llama3JsonParser
    separator = "; "
    call_tail = "}"

    def call_head(self, name: str) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": '

    def instructions(self, signatures: str) -> str:
        return (
            "You have access to the following functions:\n"
            f"{signatures}\n\n"
            "To call functions, answer with only JSON of the form "
            '{"name": "<function name>", "parameters": {<arguments>}}, '
            'several calls separated by "; ". Results come back inside '
            "<tool_response></tool_response> tags."
        )


FORMATS: dict[str, ToolFormat] = {"hermes": HermesFormat(), "llama3_json": Llama3JsonFormat()}


def detect_format(chat_template: str | None) -> str:
    """The parser for a chat template: `llama3_json` for Llama 3 tool templates, else
    `hermes` (also the format of Flare's fallback prompt for templates without tools)."""
    t = chat_template or ""
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or ("ipython" in t and '"parameters"' in t):
        return "llama3_json"
    return "hermes"


def get_format(name: str, chat_template: str | None = None) -> ToolFormat:
    """The format named `name` ("auto" detects it from `chat_template`).

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if name == "auto":
        name = detect_format(chat_template)
    if name not in FORMATS:
        raise ValueError(f"unknown tool parser {name!r}; expected 'auto' or one of "
                         f"{', '.join(TOOL_PARSERS)}")
    return FORMATS[name]
