"""Case api-utf8-split: characters whose UTF-8 bytes span several tokens.

SmolLM2's byte-level BPE splits emoji (🧪), CJK (推理) and accented letters across tokens;
pushing tokens one at a time must give the same text as decoding them all at once, with no
U+FFFD in any piece and no character emitted twice.
"""

from __future__ import annotations

import copy

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


def test_the_backend_decode_is_transformers_decode(tokenizer):
    """The detokenizer calls the `tokenizers` backend directly for a stock fast tokenizer
    (transformers' own `decode` adds only argument handling): on random id windows, special
    tokens among them, both give the same text with and without skip_special_tokens; a
    tokenizer whose `decode` is its own keeps it."""
    import random

    from flare.runtime.detokenize import _stock_backend

    backend = _stock_backend(tokenizer)
    assert backend is not None and IncrementalDetokenizer(tokenizer)._backend is backend
    rng = random.Random(5)
    specials = tokenizer.all_special_ids
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 6))]
        ids += rng.sample(specials, min(len(specials), rng.randrange(0, 2)))
        rng.shuffle(ids)
        for skip in (True, False):
            assert backend.decode(ids, skip_special_tokens=skip) == tokenizer.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), ids

    class OwnDecode(type(tokenizer)):
        def decode(self, token_ids, **kwargs):
            return "x"

    mine = copy.copy(tokenizer)
    mine.__class__ = OwnDecode
    assert _stock_backend(mine) is None
    assert "".join(_stream(mine, [1, 2])) == "x"  # its own decode() made the text
