"""Presence, frequency and repetition penalties and logit bias: the math on small logits,
running counts equal to a fresh count, and the engine.

Engine tests run the tiny random Qwen3; a request's output is compared with the same request
run alone, so a penalty can never leak into another row of the batch.
"""

from __future__ import annotations

import pytest
import torch

from flare.loading.checkpoint import load_checkpoint
from flare.runtime.request import GenerationRequest, SamplingParams
from flare.runtime.sampling import (PenaltyCounts, TokenHistory, apply_logit_bias,
                                    apply_penalties, sample)
from engine_helpers import output_tokens, small_engine

PROMPT_AND_COMPLETION = TokenHistory([0, 1, 2, 2, 4], num_prompt_tokens=2)


def _p(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0, **kw)


def test_penalties_match_a_hand_computation():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0, 3.0])
    out = apply_penalties(logits.clone(), _p(repetition_penalty=2.0, frequency_penalty=0.5,
                                             presence_penalty=0.25), PROMPT_AND_COMPLETION)
    # repetition over prompt+completion {0, 1, 2, 4}: 2/2, -1*2, 0.5/2, (3 unseen), 3/2;
    # then completion counts {2: 2, 4: 1}: token 2 -= 0.5*2 + 0.25, token 4 -= 0.5 + 0.25
    assert out.tolist() == pytest.approx([1.0, -2.0, -1.0, 0.0, 0.75])


def test_each_penalty_alone():
    logits = torch.tensor([2.0, -1.0, 0.5, 0.0, 3.0])
    rep = apply_penalties(logits.clone(), _p(repetition_penalty=0.5), PROMPT_AND_COMPLETION)
    assert rep.tolist() == pytest.approx([4.0, -0.5, 1.0, 0.0, 6.0])  # r < 1 rewards repeats
    freq = apply_penalties(logits.clone(), _p(frequency_penalty=-1.0), PROMPT_AND_COMPLETION)
    assert freq.tolist() == pytest.approx([2.0, -1.0, 2.5, 0.0, 4.0])  # prompt not counted
    pres = apply_penalties(logits.clone(), _p(presence_penalty=2.0), PROMPT_AND_COMPLETION)
    assert pres.tolist() == pytest.approx([2.0, -1.0, -1.5, 0.0, 1.0])


def test_penalties_keep_masked_tokens_masked_and_ignore_an_empty_completion():
    logits = torch.tensor([float("-inf"), 1.0, 1.0])
    out = apply_penalties(logits.clone(), _p(repetition_penalty=1.5, frequency_penalty=2.0),
                          TokenHistory([0, 0, 1], num_prompt_tokens=1))
    assert out[0] == float("-inf") and out[1].item() == pytest.approx(1 / 1.5 - 2.0)
    prompt_only = apply_penalties(logits.clone(), _p(frequency_penalty=2.0, presence_penalty=2),
                                  TokenHistory([1, 2], num_prompt_tokens=2))
    assert torch.equal(prompt_only, logits)


def test_running_counts_equal_a_fresh_count_at_every_step():
    """The engine's counts are updated by the new tokens only; applied at every length of a
    growing history they must give what a count of the whole history gives."""
    gen = torch.Generator().manual_seed(3)
    history = torch.randint(0, 40, (60,), generator=gen).tolist() + [-1, 999]  # 2 out of range
    params = _p(repetition_penalty=1.7, frequency_penalty=0.6, presence_penalty=-0.4)
    running = PenaltyCounts(vocab=32)
    for n in [*range(10, len(history), 3), len(history)]:  # prompt of 10, then a few a step
        logits = torch.randn(32, generator=gen)
        h = TokenHistory(history[:n], num_prompt_tokens=10)
        incremental = apply_penalties(logits.clone(), params, h._replace(counts=running))
        assert torch.equal(incremental, apply_penalties(logits.clone(), params, h))
    assert running.num_counted == len(history)
    shorter = TokenHistory(history[:12], num_prompt_tokens=10, counts=running)  # recounted
    logits = torch.randn(32, generator=gen)
    assert torch.equal(apply_penalties(logits.clone(), params, shorter),
                       apply_penalties(logits.clone(), params, shorter._replace(counts=None)))


def test_logit_bias_adds_to_its_tokens_and_keeps_masked_tokens_masked():
    logits = torch.tensor([1.0, 2.0, float("-inf"), 0.5])
    out = apply_logit_bias(logits.clone(), _p(logit_bias=((0, 3.0), (2, 100.0), (3, -0.5),
                                                          (7, 5.0))))
    assert out.tolist() == [4.0, 2.0, float("-inf"), 0.0]  # id 7 is outside the vocab


def test_logit_bias_comes_before_penalties_and_after_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    params = _p(logit_bias=((1, 3.0),), frequency_penalty=2.0, logprobs=0)
    result = sample(logits.clone(), [params], [torch.Generator()],
                    [TokenHistory([1], num_prompt_tokens=0)])
    # biased 1 + 3 = 4, then -2 for its one occurrence: 2 vs token 0's 2.0; argmax takes 0
    assert result.tokens == [0]
    assert result.logprobs[0].logprob == pytest.approx(
        torch.log_softmax(logits[0], -1)[0].item())  # the model's own distribution
    forced = sample(logits.clone(), [_p(logit_bias=((2, 100.0),))], [torch.Generator()])
    assert forced.tokens == [2]


def test_sample_penalizes_only_its_own_row():
    logits = torch.tensor([[0.0, 1.0, 0.75], [0.0, 1.0, 0.75]])
    history = TokenHistory([1], num_prompt_tokens=0)
    gens = [torch.Generator(), torch.Generator()]
    result = sample(logits, [_p(frequency_penalty=1.0), _p()], gens, [history, history])
    assert result.tokens == [2, 1]  # row 0 avoids the repeat; row 1 is untouched
    assert logits[1].tolist() == [0.0, 1.0, 0.75]


@pytest.mark.parametrize("kw, words", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logprobs": -1}, "logprobs"),
    ({"logit_bias": ((3, 100.5),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
])
def test_sampling_params_refuse_out_of_range_values(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


# --------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_checkpoint(tiny_qwen3_dir)


def _run(engine, ids, params, rid="solo") -> list[int]:
    return output_tokens(engine.run_until_idle([GenerationRequest(rid, ids, params)])[rid])


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def repeating(tiny):
    """A prompt whose greedy answer repeats tokens, and that answer."""
    engine = small_engine(tiny)
    for text in ("a a a a a a", "1, 2, 3, 4, 5,", "The weather in Paris is"):
        ids = tiny.tokenizer.encode(text)
        out = _run(engine, ids, _greedy())
        if len(set(out)) <= len(out) - 4:  # a cycle, as small models fall into
            return ids, out
    pytest.fail("no prompt gives a repeating greedy answer on the tiny model")


def test_strong_frequency_penalty_changes_a_repeating_greedy_answer(tiny, repeating):
    ids, plain = repeating
    engine = small_engine(tiny)
    penalized = _run(engine, ids, _greedy(frequency_penalty=2.0))
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain))  # fewer repeats
    assert _run(engine, ids, _greedy(repetition_penalty=5.0)) != plain
    assert _run(engine, ids, _greedy(presence_penalty=2.0)) != plain


def test_zero_penalties_give_exactly_the_unpenalized_answer(tiny, repeating):
    ids, plain = repeating
    engine = small_engine(tiny)
    zero = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)
    assert _run(engine, ids, _greedy(**zero)) == plain
    seeded = dict(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True)
    assert (_run(engine, ids, SamplingParams(**seeded, **zero))
            == _run(engine, ids, SamplingParams(**seeded)))


def test_a_penalized_request_leaves_its_batch_neighbours_unchanged(tiny, repeating):
    ids, plain = repeating
    engine = small_engine(tiny)
    other = tiny.tokenizer.encode("def add(a, b):\n    return")
    other_alone = _run(engine, other, _greedy())
    strong = _greedy(frequency_penalty=2.0, presence_penalty=1.0, repetition_penalty=3.0)
    penalized_alone = _run(engine, ids, strong)
    outs = engine.run_until_idle([GenerationRequest("pen", ids, strong),
                                  GenerationRequest("plain", ids, _greedy()),
                                  GenerationRequest("other", other, _greedy())])
    assert output_tokens(outs["plain"]) == plain
    assert output_tokens(outs["other"]) == other_alone
    assert output_tokens(outs["pen"]) == penalized_alone
    engine.check_integrity()


def test_logit_bias_bans_and_forces_tokens_in_the_engine(tiny, repeating):
    ids, plain = repeating
    engine = small_engine(tiny)
    banned = _run(engine, ids, _greedy(logit_bias=((plain[0], -100.0),)))
    assert banned[0] != plain[0]
    target = next(t for t in range(5, 100) if t not in plain)
    forced = _run(engine, ids, _greedy(logit_bias=((target, 100.0),)))
    assert forced == [target] * len(forced)
    outs = engine.run_until_idle([GenerationRequest("bias", ids, _greedy(
        logit_bias=((target, 100.0),))), GenerationRequest("plain", ids, _greedy())])
    assert output_tokens(outs["plain"]) == plain and output_tokens(outs["bias"]) == forced
    engine.check_integrity()
