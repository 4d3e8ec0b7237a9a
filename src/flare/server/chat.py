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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from flare.server.protocol import ChatMessage


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

    An assistant message without content gets "" (templates concatenate content).
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
        out.append(msg)
    return out


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


def _render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
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


def render_chat(tokenizer: Any, messages: Sequence[ChatMessage | dict[str, Any]]) -> str:
    """The prompt text for `messages`, ending with the generation prompt (policy above).

    Raises:
        ChatTemplateError: the tokenizer has no chat template, or the template rejects the
            conversation even after folding late system messages.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model has no chat template; use /v1/completions")
    plain = to_template_messages(messages)
    try:
        return _render(tokenizer, plain)
    except Exception as first_error:  # noqa: BLE001 - see _first_failing
        folded, origin = fold_late_system(plain)
        if len(folded) != len(plain):
            try:
                return _render(tokenizer, folded)
            except Exception:  # noqa: BLE001
                pass
            index, reason = _first_failing(tokenizer, folded)
            index = origin[index] if index is not None else None
        else:
            index, reason = _first_failing(tokenizer, plain)
        reason = reason or str(first_error) or type(first_error).__name__
        where = f"message {index}" if index is not None else "the conversation"
        raise ChatTemplateError(
            f"the model's chat template cannot render {where}: {reason}", index
        ) from first_error


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage | dict[str, Any]]) -> list[int]:
    """Prompt token ids: `render_chat` then tokenize without adding special tokens.

    Raises:
        ChatTemplateError: as `render_chat`.
    """
    prompt = render_chat(tokenizer, messages)
    return list(tokenizer.encode(prompt, add_special_tokens=False))
