"""Logprobs: the sampler computes them only when asked, from the model's raw distribution;
the engine reports them with their tokens; the server writes OpenAI's shapes.

The reference is transformers' own forward of the same tiny Qwen3 (as in
tests/parity/test_llama_parity.py): a greedy request's token logprobs must equal
`log_softmax` of its logits at those positions.
"""

from __future__ import annotations

import pytest
import torch

from flare.loading.checkpoint import load_checkpoint
from flare.runtime.request import GenerationRequest, SamplingParams, TokenLogprob
from flare.runtime.sampling import TokenHistory, sample
from flare.server.logprobs import (
    FLOOR,
    TextOffsets,
    chat_logprobs,
    completion_logprobs,
    token_text,
)
from engine_helpers import output_tokens, small_engine

PROMPT = "Paged attention stores keys and values in"


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_checkpoint(tiny_qwen3_dir)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw})


def _logprobs(outs) -> list[TokenLogprob]:
    return [lp for o in outs for lp in o.logprobs]


# --------------------------------------------------------------------------- the sampler


def test_rows_that_did_not_ask_compute_no_logprobs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("log_softmax computed for a request without logprobs")

    monkeypatch.setattr(torch, "log_softmax", refuse)
    result = sample(torch.randn(3, 50), [_greedy()] * 3, [torch.Generator()] * 3)
    assert result.logprobs == [None, None, None]


def test_logprobs_come_from_the_raw_distribution_before_penalties_and_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 64) * 3
    raw = torch.log_softmax(logits, dim=-1)
    params = [SamplingParams(temperature=0.3, top_p=0.5, frequency_penalty=2.0,
                             repetition_penalty=1.5, seed=1, logprobs=4),
              _greedy()]
    history = TokenHistory(raw[0].topk(3).indices.tolist(), num_prompt_tokens=1)
    result = sample(logits.clone(), params, [torch.Generator().manual_seed(1)] * 2,
                    [history, history])
    lp, token = result.logprobs[0], result.tokens[0]
    assert lp.token_id == token and lp.logprob == pytest.approx(raw[0, token].item(), abs=1e-6)
    top_ids, top_vals = zip(*lp.top)
    assert list(top_ids) == raw[0].topk(4).indices.tolist()
    assert list(top_vals) == pytest.approx(raw[0].topk(4).values.tolist(), abs=1e-6)
    assert result.logprobs[1] is None


# --------------------------------------------------------------------------- the engine


def test_greedy_logprobs_equal_transformers_log_softmax(tiny, tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    ids = tiny.tokenizer.encode(PROMPT)
    outs = small_engine(tiny).run_until_idle(
        [GenerationRequest("a", ids, _greedy(logprobs=5))])["a"]
    got, lps = output_tokens(outs), _logprobs(outs)
    assert [lp.token_id for lp in lps] == got and len(got) == 12
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids + got])).logits[0].float()  # [T, vocab]
    ref = torch.log_softmax(logits[len(ids) - 1:-1], dim=-1)  # row i predicts token i
    for i, (token, lp) in enumerate(zip(got, lps)):
        assert lp.logprob == pytest.approx(ref[i, token].item(), abs=1e-4)
        # greedy: the sampled token is the argmax, so it leads top_logprobs
        assert lp.top[0][0] == token and lp.top[0][1] == lp.logprob
        assert [t for t, _ in lp.top] == ref[i].topk(5).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(ref[i].topk(5).values.tolist(), abs=1e-4)


def test_no_logprobs_unless_asked_and_none_for_the_stop_token(tiny):
    engine = small_engine(tiny)
    ids = tiny.tokenizer.encode(PROMPT)
    plain = engine.run_until_idle([GenerationRequest("p", ids, _greedy())])["p"]
    assert all(o.logprobs is None for o in plain)
    stop = output_tokens(plain)[4]
    outs = engine.run_until_idle([GenerationRequest(
        "s", ids, _greedy(logprobs=0, stop_token_ids=(stop,)))])["s"]
    assert outs[-1].finish_reason == "stop" and output_tokens(outs)[-1] == stop
    lps = _logprobs(outs)
    assert [lp.token_id for lp in lps] == output_tokens(outs)[:-1]  # the stop token has none
    assert all(lp.top == () for lp in lps)  # logprobs=0: no alternatives


def test_logprobs_in_a_batch_equal_logprobs_alone(tiny):
    engine = small_engine(tiny)
    a = tiny.tokenizer.encode(PROMPT)
    b = tiny.tokenizer.encode("def add(a, b):\n    return")
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True,
                             logprobs=2, presence_penalty=1.0)
    alone = [_logprobs(engine.run_until_idle([GenerationRequest("x", ids, p)])["x"])
             for ids, p in ((a, _greedy(logprobs=3)), (b, sampled))]
    outs = engine.run_until_idle([GenerationRequest("a", a, _greedy(logprobs=3)),
                                  GenerationRequest("b", b, sampled),
                                  GenerationRequest("c", b, _greedy())])
    for got, want in zip((_logprobs(outs["a"]), _logprobs(outs["b"])), alone):
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want]
        assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want],
                                                            abs=1e-5)


class ForcedTokens:
    """A TokenConstraint allowing exactly one token per step (the next of `forced`)."""

    def __init__(self, forced: list[int]) -> None:
        self.forced, self.i = forced, 0

    def allowed(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.forced[self.i]] = True
        return mask

    def advance(self, token_id: int) -> None:
        self.i += 1

    def is_done(self) -> bool:
        return self.i == len(self.forced)


def test_logprobs_under_a_constraint_are_over_the_allowed_tokens(tiny):
    forced = tiny.tokenizer.encode('{"a": 1}', add_special_tokens=False)
    req = GenerationRequest("c", tiny.tokenizer.encode(PROMPT),
                            SamplingParams(max_tokens=20, seed=3, logprobs=2),
                            constraint=ForcedTokens(forced))
    lps = _logprobs(small_engine(tiny).run_until_idle([req])["c"])
    assert [lp.token_id for lp in lps] == forced
    for lp in lps:  # one allowed token: probability 1; the rest are -inf
        assert lp.logprob == 0.0 and lp.top[0] == (lp.token_id, 0.0)
        assert lp.top[1][1] == float("-inf")


# --------------------------------------------------------------------------- the response shapes


def test_token_bytes_rebuild_text_split_inside_characters(tiny):
    tok = tiny.tokenizer
    text = "Reply: 推理 🧪 café <|im_end|>\n  x"
    ids = tok.encode(text, add_special_tokens=False)
    texts = token_text(tok)
    assert b"".join(texts.bytes_of(i) for i in ids) == text.encode()
    partial = [i for i in ids if "\\x" in texts.text_of(i)]
    assert partial, "expected a token holding part of a character"
    assert all("\ufffd" not in texts.text_of(i) for i in ids)
    offsets = TextOffsets()
    starts = [offsets.next(texts.bytes_of(i)) for i in ids]
    assert starts == sorted(starts) and starts[0] == 0
    assert text[starts[-1]:] == " x"


def test_chat_and_completion_shapes(tiny):
    tok = tiny.tokenizer
    hello, world = tok.encode("Hello", add_special_tokens=False)[0], tok.encode(
        " world", add_special_tokens=False)[0]
    entries = [TokenLogprob(hello, -0.5, ((hello, -0.5), (world, -1.5))),
               TokenLogprob(world, -2.0, ((hello, -0.25), (7, float("-inf"))))]
    chat = chat_logprobs(entries, tok).model_dump()
    first, second = chat["content"]
    assert first == {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"),
                     "top_logprobs": [
                         {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")},
                         {"token": " world", "logprob": -1.5, "bytes": list(b" world")}]}
    assert second["top_logprobs"][1]["logprob"] == FLOOR  # JSON has no -inf
    comp = completion_logprobs(entries, tok).model_dump()
    assert comp["tokens"] == ["Hello", " world"]
    assert comp["token_logprobs"] == [-0.5, -2.0]
    assert comp["text_offset"] == [0, 5]
    # the sampled token is always listed, even when outside the top k
    assert comp["top_logprobs"][1] == {"Hello": -0.25, token_text(tok).text_of(7): FLOOR,
                                       " world": -2.0}
    assert chat_logprobs(None, tok) is None and completion_logprobs(None, tok) is None


# --------------------------------------------------------------------------- streaming


def _stream(kind, outputs, tokenizer, parser=None) -> list[dict]:
    import asyncio
    import json

    from flare.server.streaming import ChunkBuilder, sse_stream

    async def gen():
        for out in outputs:
            yield 0, out

    async def go():
        builder = ChunkBuilder(kind, "id", "m", 0, None, False, tokenizer=tokenizer)
        return [e async for e in sse_stream(gen(), builder, 1, [parser])]

    events = asyncio.run(go())
    assert events[-1] == "data: [DONE]\n\n"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def test_stream_logprobs_wait_for_the_text_their_tokens_carry(tiny):
    from flare.runtime.request import RequestOutput

    tok = tiny.tokenizer
    a, b, c = (tok.encode(t, add_special_tokens=False)[0] for t in ("Hello", " there", " you"))
    lp = {t: TokenLogprob(t, -0.5 * (i + 1), ((t, -0.5 * (i + 1)),))
          for i, t in enumerate((a, b, c))}
    outputs = [
        RequestOutput("r", [a], "Hello", logprobs=(lp[a],)),
        RequestOutput("r", [b], "", logprobs=(lp[b],)),  # held back: maybe a stop string
        RequestOutput("r", [c], " there you", logprobs=(lp[c],)),
        RequestOutput("r", [2], "", finished=True, finish_reason="stop", logprobs=()),
    ]
    chat = _stream("chat", outputs, tok)
    carried = [[e["token"] for e in ch["choices"][0]["logprobs"]["content"]]
               if ch["choices"][0]["logprobs"] else None for ch in chat]
    assert carried == [None, ["Hello"], [" there", " you"], None]  # opening, texts, finish
    comp = _stream("completion", outputs, tok)
    lps = [ch["choices"][0]["logprobs"] for ch in comp]
    assert [x["tokens"] if x else None for x in lps] == [["Hello"], [" there", " you"], None]
    assert [x["text_offset"] if x else None for x in lps] == [[0], [5, 11], None]


def test_stream_logprobs_ride_on_tool_call_chunks(tiny):
    from flare.runtime.request import RequestOutput
    from flare.server.tool_parsers import HermesParser

    tok = tiny.tokenizer
    entry = TokenLogprob(5, -1.0)
    outputs = [
        RequestOutput("r", [5], "<tool_call>\n", logprobs=(entry,)),
        RequestOutput("r", [5], '{"name": "f", "arguments": {}}\n</tool_call>',
                      logprobs=(entry,)),
        RequestOutput("r", [2], "", finished=True, finish_reason="stop", logprobs=()),
    ]
    chunks = _stream("chat", outputs, tok, HermesParser(["f"]))
    with_lp = [ch for ch in chunks if ch["choices"][0]["logprobs"]]
    assert len(with_lp) == 1 and "tool_calls" in with_lp[0]["choices"][0]["delta"]
    assert len(with_lp[0]["choices"][0]["logprobs"]["content"]) == 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
