"""Case api-utf8-split: characters whose UTF-8 bytes span several tokens.

SmolLM2's byte-level BPE splits emoji (🧪), CJK (推理) and accented letters across tokens;
pushing tokens one at a time must give the same text as decoding them all at once, with no
U+FFFD in any piece and no character emitted twice.
"""

from __future__ import annotations

import pytest

from flare.runtime.detokenize import IncrementalDetokenizer

TEXTS = [
    "推理 🧪 café",
    "🧪🧪🧪",
    "推理推理，模型。",
    "naïve café crème brûlée",
    "def reverse(s: str) -> str:\n    return s[::-1]  # 🔁\n",
    "mixed: 日本語 Ελληνικά русский 👩‍👩‍👧 end",
    "",
]


def _stream(tokenizer, ids, **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_whole_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = _stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces), pieces


def test_multibyte_characters_really_span_tokens(tokenizer):
    # Guards the test above: if the tokenizer ever kept these characters whole, the
    # holding-back logic would go untested.
    ids = tokenizer.encode("推理 🧪", add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_piece_is_empty_while_character_unfinished(tokenizer):
    ids = tokenizer.encode("🧪", add_special_tokens=False)
    assert len(ids) > 1
    pieces = _stream(tokenizer, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1)
    assert "".join(pieces) == "🧪"


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("Hi", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(_stream(tokenizer, ids)) == "Hi"
    kept = "".join(_stream(tokenizer, ids, skip_special_tokens=False))
    assert kept == "Hi" + tokenizer.eos_token


def test_partial_character_at_end_is_dropped(tokenizer):
    # Output cut (e.g. by max_tokens) in the middle of a character: the partial character
    # is not sent as U+FFFD; everything before it is.
    ids = tokenizer.encode("ok 🧪", add_special_tokens=False)[:-1]
    assert tokenizer.decode(ids).endswith("\ufffd")
    pieces = _stream(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids).rstrip("\ufffd")
    assert not any("\ufffd" in p for p in pieces)


def test_long_output_is_windowed(tokenizer):
    # Each push decodes a short window, not the whole output.
    calls: list[int] = []

    class Counting:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = tokenizer.encode("word " * 400 + "推理 🧪 " * 50, add_special_tokens=False)
    detok = IncrementalDetokenizer(Counting())
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    assert max(calls) <= 8
