"""Rules every surface's request schema shares: strict types (`StrictRequest`), tool names
(`check_tool_name`, `check_distinct_tool_names`), JSON schemas (`check_schema`), how a
tool choice turns into a tool mode (`tool_mode`), the tool checks of chat's and Responses'
requests (`ToolRequest`), and the refusal of a field Flare does not serve (`refused`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

ToolMode = Literal["none", "auto", "required", "named"]


class StrictRequest(BaseModel):
    """Base of request models: unknown fields are ignored (agent clients send many); types
    are strict, as OpenAI's API is: "5" is not coerced to 5 nor "yes" to True."""

    model_config = ConfigDict(extra="ignore", strict=True)


def refused(*fields: str, message: str, when: Callable[[Any], bool] = bool) -> Any:
    """A field validator, to assign in a request model's body, that refuses `fields`
    whenever `when(value)` holds (default: the value is truthy), with `message`: a field
    the schema accepts so that it can say why Flare does not serve it (a 400 naming it)."""
    def check(cls: type, v: Any) -> Any:
        if when(v):
            raise ValueError(message)
        return v

    return field_validator(*fields)(classmethod(check))


_TOOL_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]+")
OPENAI_TOOL_NAME_MAX = 64  # OpenAI's function names (chat and Responses)
ANTHROPIC_TOOL_NAME_MAX = 128  # Anthropic's tool names


def check_tool_name(name: str, max_length: int, what: str = "function name") -> str:
    """Return `name` if it is a valid tool name: 1 to `max_length` characters of a-z, A-Z,
    0-9, `_` and `-` (the rule of every surface; the length is the surface's: OpenAI 64,
    Anthropic 128).

    Raises:
        ValueError: naming the value and the rule (`what` names the field in the message).
    """
    if len(name) > max_length or not _TOOL_NAME_CHARS.fullmatch(name):
        raise ValueError(f"{what} {name!r} must be 1-{max_length} characters of a-z, A-Z, "
                         "0-9, _ and -")
    return name


def check_distinct_tool_names(names: Sequence[str]) -> None:
    """Refuse a tool list that names one tool twice (every API surface's rule).

    Raises:
        ValueError: naming the first repeated name.
    """
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"two tools are named {dup!r}; names must be distinct")


def check_schema(schema: dict[str, Any]) -> None:
    """Raise ValueError unless `schema` is a valid JSON Schema (any draft's meta-schema)."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except RecursionError:
        raise ValueError("JSON schema is nested too deeply") from None
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise ValueError(f"not a valid JSON schema{f' at {where}' if where else ''}: "
                         f"{e.message}") from None


def tool_mode(tools: Sequence[Any] | None, tool_choice: Any, named: type) -> ToolMode:
    """How a request uses its tools: "none" (not rendered, not parsed), "auto" (the model
    chooses), "required" / "named" (a call is forced by a grammar).

    Args:
        tools: the request's tools (None or empty: "none").
        tool_choice: "none", "auto", "required", None (auto) or a named choice.
        named: the surface's named-choice model (an instance of it means "named").
    """
    if not tools or tool_choice == "none":
        return "none"
    if isinstance(tool_choice, named):
        return "named"
    return "required" if tool_choice == "required" else "auto"


def check_tool_choice(tool_choice: Any, names: Sequence[str], forced_name: str | None) -> None:
    """Refuse a tool choice the tools cannot meet (chat's and Responses' rule).

    Args:
        tool_choice: the request's choice ("required" needs a tool).
        names: the request's tool names.
        forced_name: the function a named choice forces, else None; it must be in `names`.

    Raises:
        ValueError: naming the choice and the tools given.
    """
    if tool_choice == "required" and not names:
        raise ValueError("tool_choice 'required' needs tools")
    if forced_name is not None and forced_name not in names:
        raise ValueError(f"tool_choice names function {forced_name!r}, which is not in tools "
                         f"({', '.join(names) or 'none given'})")


class ToolRequest(StrictRequest):
    """Base of a request with `tools` and `tool_choice` fields (chat's and Responses'
    shape; the subclass declares both, `tools` first): tool names are distinct, a choice
    names a listed tool, and `tool_mode` / `forced_tool_name` say how tools are used.

    A subclass names its named-choice model (`named_choice`) and where a tool and a named
    choice keep the function's name (`tool_name`, `choice_name`).
    """

    named_choice: ClassVar[type]

    @staticmethod
    def tool_name(tool: Any) -> str:
        raise NotImplementedError

    @staticmethod
    def choice_name(choice: Any) -> str:
        raise NotImplementedError

    @classmethod
    def _forced(cls, choice: Any) -> str | None:
        return cls.choice_name(choice) if isinstance(choice, cls.named_choice) else None

    @field_validator("tools", check_fields=False)
    @classmethod
    def _distinct_names(cls, v: list[Any] | None) -> list[Any] | None:
        check_distinct_tool_names([cls.tool_name(t) for t in v or ()])
        return v or None

    @field_validator("tool_choice", check_fields=False)
    @classmethod
    def _choice_needs_tools(cls, v: Any, info: ValidationInfo) -> Any:
        names = [cls.tool_name(t) for t in info.data.get("tools") or ()]
        check_tool_choice(v, names, cls._forced(v))
        return v

    @property
    def tool_mode(self) -> ToolMode:
        """How tools are used (`tool_mode`)."""
        return tool_mode(self.tools, self.tool_choice, self.named_choice)

    @property
    def forced_tool_name(self) -> str | None:
        """The function a named choice forces, else None."""
        return self._forced(self.tool_choice)
