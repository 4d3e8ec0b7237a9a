"""Cases api-system-and-empty and api-late-system-message: chat rendering policy.

SmolLM2's ChatML template accepts any order of roles, so its conversations render as given;
a strict template (system first, then alternating user/assistant, as many models have)
exercises the fold-late-system fallback and the 400 that names the failing message.
"""

from __future__ import annotations

import pytest

from flare.server.chat import (
    ChatTemplateError,
    chat_prompt_ids,
    fold_late_system,
    render_chat,
)
from template_tokenizer import TemplateTokenizer

GEN_PROMPT = "<|im_start|>assistant\n"

# system first, no empty content: raises like many models' templates do
STRICT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System message must be first') }}{% endif %}"
    "{% if m['content'] == '' %}{{ raise_exception('Empty content') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
)


def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


# ---------------------------------------------------------------- SmolLM2 ChatML template


def test_prompt_ends_with_generation_prompt(tokenizer):
    prompt = render_chat(tokenizer, _msgs(("user", "Hi")))
    assert prompt.endswith(GEN_PROMPT)
    # SmolLM2's template adds its default system prompt when there is none.
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant")


def test_two_system_messages_rendered_as_given(tokenizer):
    prompt = render_chat(tokenizer, _msgs(("system", "A"), ("system", "B"), ("user", "Hi")))
    assert "<|im_start|>system\nA<|im_end|>\n<|im_start|>system\nB<|im_end|>" in prompt
    assert prompt.endswith(GEN_PROMPT)


def test_late_system_message_kept_in_place(tokenizer):
    # api-late-system-message: system, user, assistant, system, user -> 200, in place, so
    # the tokens of the earlier turns (the cached prefix) do not change.
    msgs = _msgs(("system", "S"), ("user", "U1"), ("assistant", "A1"), ("system", "late"),
                 ("user", "U2"))
    prompt = render_chat(tokenizer, msgs)
    earlier = render_chat(tokenizer, msgs[:3])
    assert prompt.startswith(earlier[: -len(GEN_PROMPT)])
    assert "<|im_start|>system\nlate<|im_end|>\n<|im_start|>user\nU2" in prompt
    assert prompt.endswith(GEN_PROMPT)


def test_empty_user_content_and_no_user_message(tokenizer):
    # api-system-and-empty
    assert render_chat(tokenizer, _msgs(("user", ""))).endswith(
        "<|im_start|>user\n<|im_end|>\n" + GEN_PROMPT
    )
    only_system = render_chat(tokenizer, _msgs(("system", "Be brief.")))
    assert only_system == "<|im_start|>system\nBe brief.<|im_end|>\n" + GEN_PROMPT


def test_content_parts_developer_role_and_null_assistant(tokenizer):
    msgs = [
        {"role": "developer", "content": [{"type": "text", "text": "D"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    prompt = render_chat(tokenizer, msgs)
    assert prompt.startswith("<|im_start|>system\nD<|im_end|>\n<|im_start|>user\na\nb<|im_end|>")
    assert "<|im_start|>assistant\n<|im_end|>" in prompt
    assert "<|im_start|>tool\n42<|im_end|>" in prompt


def test_prompt_ids_have_no_added_bos(tokenizer):
    ids = chat_prompt_ids(tokenizer, _msgs(("user", "Hi")))
    # SmolLM2's BOS is "<|im_start|>": the template writes it once, nothing adds another.
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids[1] != ids[0]
    assert tokenizer.decode(ids, skip_special_tokens=False) == render_chat(
        tokenizer, _msgs(("user", "Hi"))
    )
    assert ids[-3:] == tokenizer.encode(GEN_PROMPT, add_special_tokens=False)[-3:]


# ---------------------------------------------------------------- strict template fallback


def test_strict_template_late_system_is_folded(tokenizer):
    strict = TemplateTokenizer(tokenizer, STRICT_TEMPLATE)
    msgs = _msgs(("system", "S"), ("user", "U1"), ("assistant", "A1"), ("system", "late"),
                 ("user", "U2"))
    prompt = render_chat(strict, msgs)
    assert prompt == "[system]S\n\nlate\n[user]U1\n[assistant]A1\n[user]U2\n[assistant]"


def test_strict_template_late_system_without_leading_system(tokenizer):
    strict = TemplateTokenizer(tokenizer, STRICT_TEMPLATE)
    prompt = render_chat(strict, _msgs(("user", "U"), ("system", "X"), ("system", "Y")))
    assert prompt == "[system]X\n\nY\n[user]U\n[assistant]"


def test_strict_template_error_names_message_index(tokenizer):
    strict = TemplateTokenizer(tokenizer, STRICT_TEMPLATE)
    msgs = _msgs(("system", "S"), ("user", "U1"), ("assistant", "A1"), ("system", "late"),
                 ("user", ""))
    with pytest.raises(ChatTemplateError) as exc:
        render_chat(strict, msgs)
    # Index in the request's messages, not in the folded list.
    assert exc.value.message_index == 4
    assert "message 4" in str(exc.value) and "Empty content" in str(exc.value)


def test_no_chat_template_is_an_error():
    class Bare:
        chat_template = None

    with pytest.raises(ChatTemplateError):
        render_chat(Bare(), _msgs(("user", "Hi")))


def test_fold_late_system_origin():
    msgs = _msgs(("system", "S"), ("user", "U"), ("system", "L"), ("user", "V"))
    folded, origin = fold_late_system(msgs)
    assert [m["content"] for m in folded] == ["S\n\nL", "U", "V"]
    assert origin == [0, 1, 3]
