"""Log-probabilities in OpenAI's response shapes (docs/api-extensions.md, "Logprobs").

The engine reports `TokenLogprob`s (token ids, natural-log probabilities). Here they become
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}], "refusal": null}`;
- text completion: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
  "text_offset"}`, where each `top_logprobs` dict also holds the sampled token (so up to
  k + 1 entries, as OpenAI documents).

A token's `bytes` are exactly what it adds to the text: byte-level BPE tokens (GPT-2,
Llama 3, Qwen, SmolLM) are mapped back through the byte alphabet; otherwise `<0xNN>` byte
tokens are that byte and SentencePiece's `▁` is a space; added tokens are their content.
`token` is those bytes as UTF-8, with bytes that do not form a whole character (a token
holding part of one) written as `\\xNN` escapes. Joining the `bytes` of a reply's tokens
gives its UTF-8 text (before stop strings are cut).

JSON has no infinity: a -inf logprob (a token a constraint forbids) or a NaN is reported as
-9999.0, as vLLM does.
"""

from __future__ import annotations

import codecs
import copy
import re
import weakref
from collections.abc import Sequence
from typing import Any

from flare.runtime.request import TokenLogprob
from flare.server.openai.replies import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

FLOOR = -9999.0  # what -inf and NaN become
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def finite(logprob: float) -> float:
    """`logprob`, or `FLOOR` when it is below it, -inf or NaN."""
    return logprob if logprob > FLOOR else FLOOR


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte, inverted (char -> byte).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes, in order, take the
    characters from U+0100 on.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1),
                 *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


_BYTE_OF_CHAR = _byte_alphabet()


class TokenText:
    """Each token's exact bytes and display text, for one tokenizer (cached per token id).

    Args:
        tokenizer: a transformers tokenizer; a fast one (with `backend_tokenizer`) gives
            exact bytes, a slow one falls back to `decode([id])` (partial characters then
            come out as U+FFFD).
    """

    def __init__(self, tokenizer: Any) -> None:
        # a private copy: the served tokenizer encodes prompts in worker threads, and a Rust
        # tokenizer borrowed mutably by one thread raises in another
        self._tok = copy.deepcopy(tokenizer)
        self._cache: dict[int, bytes] = {}
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {i: str(getattr(t, "content", t)) for i, t in added.items()}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None) if backend is not None else None
        state = b""
        if decoder is not None:
            try:
                state = decoder.__getstate__()
            except Exception:  # noqa: BLE001 - an unknown decoder: use the plain fallback
                state = b""
        self._byte_level = b'"ByteLevel"' in state
        self._pieces = backend is not None and not self._byte_level

    def bytes_of(self, token_id: int) -> bytes:
        """The UTF-8 bytes token `token_id` adds to the text."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._cache[token_id] = self._compute(token_id)
        return cached

    def text_of(self, token_id: int) -> str:
        """`bytes_of` as text; bytes that are not a whole character become `\\xNN`."""
        return self.bytes_of(token_id).decode("utf-8", errors="backslashreplace")

    def _compute(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = None
        if self._byte_level or self._pieces:
            piece = self._tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
                return bytes(_BYTE_OF_CHAR[c] for c in piece)
            if self._pieces:
                m = _BYTE_TOKEN.match(piece)
                return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
        return self._tok.decode([token_id]).encode()


_TEXTS: "weakref.WeakKeyDictionary[Any, TokenText]" = weakref.WeakKeyDictionary()


def token_text(tokenizer: Any) -> TokenText:
    """The (shared, cached) `TokenText` of `tokenizer`."""
    try:
        found = _TEXTS.get(tokenizer)
        if found is None:
            found = _TEXTS[tokenizer] = TokenText(tokenizer)
        return found
    except TypeError:  # not weak-referenceable or not hashable: no sharing
        return TokenText(tokenizer)


class TextOffsets:
    """Character offsets of successive tokens in the completion text (`text_offset`).

    A token's offset is the number of whole characters its predecessors' bytes decode to,
    so a token that completes a character split across tokens points at that character.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._chars = 0

    def next(self, token_bytes: bytes) -> int:
        """The offset of a token with `token_bytes`, then advance past it."""
        offset = self._chars
        self._chars += len(self._decoder.decode(token_bytes))
        return offset


def chat_logprobs(entries: Sequence[TokenLogprob] | None, tokenizer: Any) -> ChatLogprobs | None:
    """The chat `logprobs` object of `entries` (None when the request did not ask)."""
    if entries is None:
        return None
    texts = token_text(tokenizer)

    def top(token_id: int, logprob: float) -> TopLogprob:
        b = texts.bytes_of(token_id)
        return TopLogprob(token=texts.text_of(token_id), logprob=finite(logprob), bytes=list(b))

    return ChatLogprobs(content=[
        ChatTokenLogprob(**top(e.token_id, e.logprob).model_dump(),
                         top_logprobs=[top(t, lp) for t, lp in e.top])
        for e in entries])


def completion_logprobs(entries: Sequence[TokenLogprob] | None, tokenizer: Any,
                        offsets: TextOffsets | None = None) -> CompletionLogprobs | None:
    """The text-completion `logprobs` object of `entries` (None when not asked).

    Args:
        offsets: the choice's running offsets when a stream sends its tokens in several
            chunks; None starts at 0.
    """
    if entries is None:
        return None
    texts = token_text(tokenizer)
    offsets = offsets or TextOffsets()
    out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for e in entries:
        out.tokens.append(texts.text_of(e.token_id))
        out.token_logprobs.append(finite(e.logprob))
        top: dict[str, float] = {}
        for t, lp in (*e.top, (e.token_id, e.logprob)):
            top.setdefault(texts.text_of(t), finite(lp))  # two ids may share a text
        out.top_logprobs.append(top)
        out.text_offset.append(offsets.next(texts.bytes_of(e.token_id)))
    return out
