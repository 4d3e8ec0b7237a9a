"""Rendering tools, tool calls and tool results into prompts (docs/agents.md, "Prompts").

SmolLM2's ChatML template has no tool support: Flare's fallback describes the tools in the
system message and writes calls and results as text. A template that reads `tools` renders
them itself; one that raises on them falls back instead of failing.
"""

from __future__ import annotations

import pytest

from flare.server.chat import ChatTemplateError, render_chat, supports_tools
from flare.server.tool_formats import FORMATS
from template_tokenizer import TemplateTokenizer

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
TURN1 = [{"role": "user", "content": "Weather in Paris?"}]
TURN2 = TURN1 + [
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]

TOOL_TEMPLATE = (
    "{% if tools %}[tools]{{ tools | map(attribute='function') | map(attribute='name') "
    "| join(',') }}\n{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<call>{{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}</call>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
RAISING_TOOL_TEMPLATE = (
    "{% if tools %}{% endif %}{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
    "[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_smollm2_template_has_no_tool_support(tokenizer):
    assert not supports_tools(tokenizer)
    assert supports_tools(TemplateTokenizer(tokenizer, TOOL_TEMPLATE))


def test_fallback_describes_tools_in_system_prompt(tokenizer):
    prompt = render_chat(tokenizer, TURN1, TOOLS)
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in system and "<tool_call>" in system
    assert prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                           "<|im_start|>assistant\n")


def test_fallback_appends_to_existing_system_message(tokenizer):
    prompt = render_chat(tokenizer, [{"role": "system", "content": "Be brief."}] + TURN1, TOOLS)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")


def test_fallback_renders_calls_and_results_as_text(tokenizer):
    prompt = render_chat(tokenizer, TURN2, TOOLS)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>') in prompt
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in prompt
    assert "<|im_start|>tool" not in prompt


def test_consecutive_tool_results_share_one_user_message(tokenizer):
    two = {**CALL, "id": "call_2"}
    msgs = TURN1 + [{"role": "assistant", "content": "Checking.", "tool_calls": [CALL, two]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "a"},
                    {"role": "tool", "tool_call_id": "call_2", "content": "b"}]
    prompt = render_chat(tokenizer, msgs, TOOLS)
    assert ("<|im_start|>assistant\nChecking.\n<tool_call>" in prompt)
    assert ("<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
            "</tool_response><|im_end|>") in prompt


def test_next_turn_extends_the_previous_prompt(tokenizer):
    """What the model wrote (the forced call text) is what the next prompt holds, so the
    conversation's earlier tokens stay a reusable prefix."""
    first = render_chat(tokenizer, TURN1, TOOLS)
    written = FORMATS["hermes"].call_text("get_weather", '{"city": "Paris"}')
    assert render_chat(tokenizer, TURN2, TOOLS).startswith(first + written + "<|im_end|>")


def test_tool_choice_none_keeps_history_but_no_tools(tokenizer):
    prompt = render_chat(tokenizer, TURN2, None)
    assert "# Tools" not in prompt
    assert "<tool_call>" in prompt and "<tool_response>" in prompt


def test_llama3_json_fallback_format(tokenizer):
    prompt = render_chat(tokenizer, TURN2, TOOLS, FORMATS["llama3_json"])
    assert '"parameters"' in prompt.split("<|im_end|>")[0]
    assert '<|im_start|>assistant\n{"name": "get_weather", "parameters": {"city": "Paris"}}' \
        in prompt


def test_tool_aware_template_renders_tools_itself(tokenizer):
    prompt = render_chat(TemplateTokenizer(tokenizer, TOOL_TEMPLATE), TURN2, TOOLS)
    assert prompt.startswith("[tools]get_weather\n")
    # arguments reach the template as an object (the transformers convention)
    assert '<call>get_weather {"city": "Paris"}</call>' in prompt
    assert "[tool]sunny" in prompt and prompt.endswith("[assistant]")


def test_tool_aware_template_that_raises_falls_back(tokenizer):
    prompt = render_chat(TemplateTokenizer(tokenizer, RAISING_TOOL_TEMPLATE), TURN2, TOOLS)
    assert prompt.startswith("[system]# Tools")
    assert "[user]<tool_response>\nsunny\n</tool_response>" in prompt


def test_template_errors_still_name_the_request_message(tokenizer):
    strict = ("{% for m in messages %}{% if m['content'] == 'boom' %}"
              "{{ raise_exception('bad') }}{% endif %}[{{ m['role'] }}]{{ m['content'] }}"
              "{% endfor %}")
    msgs = TURN2 + [{"role": "user", "content": "boom"}]
    with pytest.raises(ChatTemplateError) as exc:
        render_chat(TemplateTokenizer(tokenizer, strict), msgs, TOOLS)
    assert exc.value.message_index == 3
