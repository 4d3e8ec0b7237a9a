"""Render a chat conversation into prompt token ids with the model's own chat template.

Policy for unusual conversations (cases api-system-and-empty, api-late-system-message):

1. The conversation is first rendered exactly as given, with the "developer" role renamed
   "system". Whatever the template accepts is the model's own format: two system messages,
   a system message after a user message, empty content, no user message at all. Keeping a
   late system message in place also keeps the conversation's earlier tokens unchanged, so
   an agent that inserts one mid-conversation still reuses its cached prefix.
2. If the template raises and the conversation has system messages after the first
   message, they are folded, in order, into the leading system message (joined by a blank
   line; a leading system message is created if there was none) and rendering is retried.
3. If the template still raises, `ChatTemplateError` names the first message at which
   rendering fails (found by rendering growing prefixes of the conversation) with the
   template's own message; the app answers 400, never 500.

The prompt is rendered with `add_generation_prompt=True`, so it ends with the template's
assistant header, then tokenized with `add_special_tokens=False` (the template already
writes any BOS it wants as text).

Tools (docs/agents.md). A template that uses a `tools` variable renders tools, assistant
`tool_calls` (arguments as objects, the transformers convention) and `tool` messages
itself, through `apply_chat_template(tools=...)`. A template without tool support (such as
SmolLM2's ChatML), or a tool-aware one that raises on the conversation, gets Flare's
fallback, rendered as ordinary messages through the same template:
- the tools are described in a section appended to the leading system message (one is
  created if there is none) in the served tool format (`ToolFormat.system_prompt`);
- an assistant message's tool calls become text after its content, exactly as the model is
  made to write them (`ToolFormat.render_calls`);
- `tool` messages become one user message per run of results, each result inside
  `<tool_response>...</tool_response>`.
The fallback is used only when the request has tools or the conversation has tool calls;
otherwise messages render as given.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from flare.server.openai.messages import ChatMessage, Tool
from flare.server.tool_formats import FORMATS, ToolFormat


class ChatTemplateError(ValueError):
    """The chat template cannot render the conversation.

    Attributes:
        message_index: index (in the request's `messages`) of the first message at which
            rendering fails, or None when the failure is not tied to one message.
    """

    def __init__(self, message: str, message_index: int | None = None) -> None:
        super().__init__(message)
        self.message_index = message_index


def to_template_messages(messages: Sequence[ChatMessage | dict[str, Any]]) -> list[dict[str, Any]]:
    """Plain dicts for the template: role ("developer" -> "system") and string content.

    An assistant message without content gets "" (templates concatenate content). Tool
    calls keep OpenAI's shape, with `arguments` parsed into an object when it is JSON (what
    tool-aware templates expect).
    """
    out = []
    for m in messages:
        m = m if isinstance(m, ChatMessage) else ChatMessage.model_validate(m)
        role = "system" if m.role == "developer" else m.role
        msg: dict[str, Any] = {"role": role, "content": m.content if m.content is not None else ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _json_or_text(
                     c.function.arguments)}}
                for c in m.tool_calls]
        out.append(msg)
    return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def tool_dicts(tools: Sequence[Tool | dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools as plain dicts without unset fields (for templates and the fallback prompt)."""
    return [t.model_dump(exclude_none=True, by_alias=True) if isinstance(t, Tool) else dict(t)
            for t in tools]


def supports_tools(tokenizer: Any) -> bool:
    """Whether the chat template reads a `tools` variable (renders tools itself)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: transformers picks "tool_use"
        if "tool_use" in template:
            return True
        template = template.get("default")
    if not isinstance(template, str):
        return False
    try:
        import jinja2
        from jinja2 import meta

        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except Exception:  # noqa: BLE001 - a template jinja2 cannot parse: look for the word
        return "tools" in template


def fallback_messages(messages: list[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                      fmt: ToolFormat) -> tuple[list[dict[str, Any]], list[int]]:
    """Tools, tool calls and tool results as plain text messages (module docstring).

    Returns:
        (messages, origin) where `origin[j]` is the index in `messages` that message j
        comes from (a created system message takes index 0).
    """
    out: list[dict[str, Any]] = []
    origin: list[int] = []
    rest = list(enumerate(messages))
    if tools:
        section = fmt.system_prompt(tools)
        if messages and messages[0]["role"] == "system":
            head = messages[0]["content"]
            out.append({"role": "system", "content": f"{head}\n\n{section}" if head else section})
            rest = rest[1:]
        else:
            out.append({"role": "system", "content": section})
        origin.append(0)
    in_results = False
    for i, m in rest:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if in_results:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + text}
            else:
                out.append({"role": "user", "content": text})
                origin.append(i)
            in_results = True
            continue
        in_results = False
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = fmt.render_calls([
                (c["function"]["name"], _arguments_text(c["function"]["arguments"]))
                for c in m["tool_calls"]])
            content = f"{m['content']}\n{calls}" if m["content"] else calls
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": content}
        out.append(m)
        origin.append(i)
    return out, origin


def _arguments_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


def fold_late_system(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[int]]:
    """Move system messages after the first message into the leading system message.

    Returns:
        (folded messages, origin) where `origin[j]` is the index in `messages` that
        folded message j came from (a created leading system message takes the index of the
        first late system message).
    """
    late = [i for i, m in enumerate(messages) if m["role"] == "system" and i > 0]
    if not late:
        return list(messages), list(range(len(messages)))
    late_text = [messages[i]["content"] for i in late]
    if messages and messages[0]["role"] == "system":
        head = dict(messages[0], content="\n\n".join([messages[0]["content"], *late_text]))
        folded, origin = [head], [0]
        start = 1
    else:
        folded, origin = [{"role": "system", "content": "\n\n".join(late_text)}], [late[0]]
        start = 0
    for i in range(start, len(messages)):
        if i not in late:
            folded.append(messages[i])
            origin.append(i)
    return folded, origin


def _render(tokenizer: Any, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None = None) -> str:
    kwargs = {"tools": tools} if tools else {}
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                           **kwargs)
    if not isinstance(prompt, str):  # some tokenizer versions wrap the result
        raise TypeError(f"chat template returned {type(prompt).__name__}, not str")
    return prompt


def _first_failing(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[int | None, str]:
    """Index and error of the shortest failing prefix; (None, "") if every prefix renders."""
    for k in range(1, len(messages) + 1):
        try:
            _render(tokenizer, messages[:k])
        except Exception as e:  # template code is arbitrary Jinja: any error is its verdict
            return k - 1, str(e) or type(e).__name__
    return None, ""


def _render_plain(tokenizer: Any, plain: list[dict[str, Any]], origin: list[int]) -> str:
    """Render as given, else with late system messages folded, else raise (policy 1-3)."""
    try:
        return _render(tokenizer, plain)
    except Exception as first_error:  # noqa: BLE001 - see _first_failing
        folded, fold_origin = fold_late_system(plain)
        if len(folded) != len(plain):
            try:
                return _render(tokenizer, folded)
            except Exception:  # noqa: BLE001
                pass
            index, reason = _first_failing(tokenizer, folded)
            index = fold_origin[index] if index is not None else None
        else:
            index, reason = _first_failing(tokenizer, plain)
        index = origin[index] if index is not None else None
        reason = reason or str(first_error) or type(first_error).__name__
        where = f"message {index}" if index is not None else "the conversation"
        raise ChatTemplateError(
            f"the model's chat template cannot render {where}: {reason}", index
        ) from first_error


def render_chat(tokenizer: Any, messages: Sequence[ChatMessage | dict[str, Any]],
                tools: Sequence[Tool | dict[str, Any]] | None = None,
                tool_format: ToolFormat | None = None) -> str:
    """The prompt text for `messages`, ending with the generation prompt (policy above).

    Args:
        tokenizer: a transformers tokenizer with a chat template.
        messages: the conversation.
        tools: tools to describe to the model (None or empty: none).
        tool_format: the served tool-call format, used by the fallback (default hermes).

    Raises:
        ChatTemplateError: the tokenizer has no chat template, or the template rejects the
            conversation even after folding late system messages.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    plain = to_template_messages(messages)
    tools_plain = tool_dicts(tools) if tools else None
    has_calls = any(m.get("tool_calls") for m in plain)
    if tools_plain or has_calls:
        if supports_tools(tokenizer):
            try:
                return _render(tokenizer, plain, tools_plain)
            except Exception:  # noqa: BLE001 - fall back to text, below
                pass
        plain, origin = fallback_messages(plain, tools_plain, tool_format or FORMATS["hermes"])
    else:
        origin = list(range(len(plain)))
    return _render_plain(tokenizer, plain, origin)


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage | dict[str, Any]],
                    tools: Sequence[Tool | dict[str, Any]] | None = None,
                    tool_format: ToolFormat | None = None) -> list[int]:
    """Prompt token ids: `render_chat` then tokenize without adding special tokens.

    Raises:
        ChatTemplateError: as `render_chat`.
    """
    prompt = render_chat(tokenizer, messages, tools, tool_format)
    return list(tokenizer.encode(prompt, add_special_tokens=False))
