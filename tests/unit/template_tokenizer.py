"""A tokenizer that renders chats with another chat template: for the tests of prompt
rendering over the SmolLM2 tokenizer (test_chat_render.py, test_tool_render.py)."""

from __future__ import annotations


class TemplateTokenizer:
    """`tok` (a transformers tokenizer) with the chat template `template`."""

    def __init__(self, tok, template: str):
        self._tok, self.chat_template = tok, template

    def apply_chat_template(self, messages, **kwargs):
        return self._tok.apply_chat_template(messages, chat_template=self.chat_template,
                                             **kwargs)

    def encode(self, text, **kwargs):
        return self._tok.encode(text, **kwargs)
