"""Turn a stream of token ids into a stream of text, one complete character at a time.

Byte-level BPE (GPT-2 style, as in SmolLM2, Llama 3, Qwen) splits one character's UTF-8
bytes across tokens: "🧪" may be three tokens that each decode alone to U+FFFD. Decoding
every token on its own would emit replacement characters; decoding the whole output at every
step is correct but O(n^2). This module uses the prefix/read offset technique (as in vLLM and
text-generation-inference): decode only a short window of recent tokens and emit the part of
it that is new and complete.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Decodes one sequence's completion tokens incrementally.

    Invariant: the concatenation of every `push` result followed by `flush()` equals
    `tokenizer.decode(all_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
    (less a partial character at the very end, see `flush`), and no piece contains a
    partial UTF-8 character.

    Window: tokens `[prefix_offset, read_offset)` were already emitted and are decoded again
    only as context, because some decoders (SentencePiece "▁", byte fallback) render a token
    differently at the start of a text than after other tokens. Tokens from `read_offset` on
    are not fully emitted yet. The window is reset after every fully emitted step, so the
    cost per token is constant unless a long run of incomplete bytes is held back.

    Args:
        tokenizer: a transformers tokenizer (anything with `decode(ids, **kwargs) -> str`).
        skip_special_tokens: drop special tokens (e.g. `<|im_end|>`) from the text.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._backend = _stock_backend(tokenizer)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        # Characters of decode(ids[prefix_offset:]) already returned. It can run past the
        # decoded length of ids[prefix_offset:read_offset] when complete characters were
        # emitted while a partial one at the end was held back.
        self._emitted = 0

    def _decode(self, ids: list[int]) -> str:
        # No tokenization-space clean-up: it rewrites " ," to "," across the boundary of
        # two pushes, which would make streamed text differ from the whole decode.
        if self._backend is not None:  # the same call, without transformers' wrapper
            return self._backend.decode(ids, skip_special_tokens=self._skip_special)
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self._skip_special,
            clean_up_tokenization_spaces=False,
        )

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is unfinished).

        Never returns a partial UTF-8 character (held back while the decoded window ends in
        U+FFFD) and never returns a character twice.
        """
        self._ids.append(int(token_id))
        text = self._decode(self._ids[self._prefix_offset :])
        # Hold back the trailing replacement characters: they are bytes of a character whose
        # remaining bytes are still to come (or, at the very end, genuinely invalid bytes,
        # which `flush` then returns as decode() would).
        complete = len(text.rstrip(_REPLACEMENT))
        if complete <= self._emitted:
            return ""
        new = text[self._emitted : complete]
        if complete == len(text):
            # Everything decoded so far is out: slide the window. The tokens just emitted
            # become the context prefix of the next decode.
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._emitted = len(self._decode(self._ids[self._prefix_offset : self._read_offset]))
        else:
            self._emitted = complete
        return new

    def flush(self) -> str:
        """Return whatever is still held back, at the end of the sequence.

        Held back here can only be the bytes of a character the sequence ended in the middle
        of (e.g. cut by max_tokens). They are dropped rather than sent as U+FFFD: a partial
        character is not text, and a client should never see a replacement character for
        one. (So the whole output is `tokenizer.decode(ids)` without its trailing U+FFFD.)
        """
        text = self._decode(self._ids[self._prefix_offset :]).rstrip(_REPLACEMENT)
        new = text[self._emitted :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._emitted = 0
        return new


def _stock_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer whose `decode` and
    `_decode` are transformers' own, else None. For those, `decode(ids,
    skip_special_tokens=s, clean_up_tokenization_spaces=False)` is exactly
    `backend_tokenizer.decode(ids, skip_special_tokens=s)` (transformers'
    `TokenizersBackend._decode`); calling the backend skips about 6 us of argument
    conversion a call, and a generated token costs two calls."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    cls = type(tokenizer)
    if (isinstance(tokenizer, PreTrainedTokenizerFast)
            and cls.decode is PreTrainedTokenizerBase.decode
            and cls._decode is PreTrainedTokenizerFast._decode):
        return getattr(tokenizer, "backend_tokenizer", None)
    return None
