"""Engine behaviour: batching, chunked prefill, preemption, aborts, sampling, stopping.

Most tests run the tiny random Qwen3 (fast); outputs are compared with the same request run
alone, which is what a user expects whatever else the server is doing.
"""

from __future__ import annotations

import pytest

from flare.loading.checkpoint import load_checkpoint
from flare.package.plan import make_plan
from flare.runtime.engine import Engine
from flare.runtime.request import RequestRejected
from flare.runtime.request import GenerationRequest, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_checkpoint(tiny_qwen3_dir)


def make_engine(ckpt, prefix_cache: bool = True, **plan_kw) -> Engine:
    kw = {"max_seq_len": 256, "max_num_seqs": 4, "max_batch_tokens": 64, **plan_kw}
    return Engine(ckpt.config, make_plan(ckpt.config, **kw), ckpt.tensors, ckpt.tokenizer,
                  prefix_cache=prefix_cache)


def tokens(outs) -> list[int]:
    return sum((o.token_ids for o in outs), [])


def text(outs) -> str:
    return "".join(o.text for o in outs)


def prompts(ckpt, n: int) -> list[list[int]]:
    base = ["Hello there, how are you today?", "def add(a, b):\n    return",
            "A long time ago in a galaxy far, far away " * 3, "1, 2, 3, 4, 5,",
            "Paged attention stores keys and values in", "The weather in Paris is"]
    return [ckpt.tokenizer.encode(base[i % len(base)] + " x" * (i // len(base)))
            for i in range(n)]


def solo(engine: Engine, ids: list[int], params: SamplingParams = GREEDY) -> list:
    return engine.run_until_idle([GenerationRequest("solo", ids, params)])["solo"]


def assert_pools_back_to_baseline(engine: Engine) -> None:
    """Idle engine: only the prefix index holds pages; clearing it empties the pool."""
    engine.check_integrity()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    cached = engine.prefix_index.num_pages if engine.prefix_index else 0
    assert engine.pool.num_used == cached
    if engine.prefix_index:
        engine.prefix_index.clear()
    assert engine.pool.num_used == 0


def assert_batched_answers_equal_solo_answers(ckpt) -> None:
    """4 prompts together on one engine of `ckpt`: each answer equals its answer alone."""
    engine = make_engine(ckpt)
    ps = prompts(ckpt, 4)
    alone = [tokens(solo(engine, ids)) for ids in ps]
    outs = engine.run_until_idle([GenerationRequest(str(i), ids, GREEDY)
                                  for i, ids in enumerate(ps)])
    assert [tokens(outs[str(i)]) for i in range(4)] == alone
    assert_pools_back_to_baseline(engine)


def test_batched_answers_equal_solo_answers(tiny):
    assert_batched_answers_equal_solo_answers(tiny)


@pytest.mark.slow
def test_smollm2_batched_answers_equal_solo_answers(embedded_checkpoint):
    assert_batched_answers_equal_solo_answers(embedded_checkpoint)


def test_chunked_prefill_equals_single_chunk_prefill(tiny):
    ids = prompts(tiny, 3)[2] * 3  # about 60 tokens
    whole = tokens(solo(make_engine(tiny, max_batch_tokens=256), ids))
    chunked = make_engine(tiny, max_batch_tokens=7)  # chunks that end mid-page
    assert tokens(solo(chunked, ids)) == whole
    assert_pools_back_to_baseline(chunked)


def test_preempted_sequences_resume_with_the_same_answer(tiny):
    ps = prompts(tiny, 3)
    roomy = make_engine(tiny)
    alone = [tokens(solo(roomy, ids, SamplingParams(max_tokens=60, temperature=0,
                                                      ignore_eos=True))) for ids in ps]
    # 6 pages of 16 tokens: the three sequences cannot all grow to ~75 tokens at once
    tight = make_engine(tiny, max_seq_len=96, num_pages=6)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    outs = tight.run_until_idle([GenerationRequest(str(i), ids, params)
                                 for i, ids in enumerate(ps)])
    assert tight.scheduler.num_preemptions > 0
    assert [tokens(outs[str(i)]) for i in range(3)] == alone
    assert_pools_back_to_baseline(tight)


def test_abort_mid_decode_frees_pages_at_once_and_spares_the_others(tiny):
    engine = make_engine(tiny, prefix_cache=False)  # a cache would keep the computed pages
    a, b = prompts(tiny, 2)
    expected_b = tokens(solo(engine, b))
    got: dict[str, list] = {"a": [], "b": []}
    engine.on_output = lambda o: got[o.request_id].append(o)
    engine.add_request(GenerationRequest("a", a, GREEDY))
    engine.add_request(GenerationRequest("b", b, GREEDY))
    for _ in range(5):
        engine.step()
    used_by_both = engine.pool.num_used
    engine.abort("a")
    engine.step()
    assert got["a"][-1].finished and got["a"][-1].finish_reason == "abort"
    assert engine.pool.num_used < used_by_both
    while engine.scheduler.has_work():
        engine.step()
    assert tokens(got["b"]) == expected_b
    assert_pools_back_to_baseline(engine)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny):
    """Case api-seed."""
    engine = make_engine(tiny)
    ids = prompts(tiny, 1)[0]
    p7 = SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True)
    p8 = SamplingParams(max_tokens=20, temperature=0.8, seed=8, ignore_eos=True)
    first, second = tokens(solo(engine, ids, p7)), tokens(solo(engine, ids, p7))
    assert first == second
    assert tokens(solo(engine, ids, p8)) != first
    outs = engine.run_until_idle([GenerationRequest("x", ids, p7), GenerationRequest("y", ids, p7),
                                  GenerationRequest("z", ids, p8)])
    assert tokens(outs["x"]) == tokens(outs["y"]) == first


def engine_and_greedy_answer(tiny) -> tuple[Engine, list[int], list[int]]:
    """A fresh engine, the first test prompt and its greedy answer there."""
    engine = make_engine(tiny)
    ids = prompts(tiny, 1)[0]
    return engine, ids, tokens(solo(engine, ids))


def stop_at(token: int) -> SamplingParams:
    """Greedy, 24 tokens, stopping at `token`."""
    return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                          stop_token_ids=(token,))


def test_top_k_1_and_tiny_top_p_are_greedy(tiny):
    engine, ids, greedy = engine_and_greedy_answer(tiny)
    for p in (SamplingParams(max_tokens=24, temperature=1.0, top_k=1, ignore_eos=True, seed=1),
              SamplingParams(max_tokens=24, temperature=1.0, top_p=1e-6, ignore_eos=True, seed=1)):
        assert tokens(solo(engine, ids, p)) == greedy


def test_max_tokens_1_gives_one_token_and_length(tiny):
    """Case api-max-tokens-edge."""
    engine = make_engine(tiny)
    outs = solo(engine, prompts(tiny, 1)[0], SamplingParams(max_tokens=1, temperature=0,
                                                            ignore_eos=True))
    assert len(tokens(outs)) == 1
    assert outs[-1].finish_reason == "length" and outs[-1].num_completion_tokens == 1


def test_generation_ends_with_length_at_the_planned_sequence_length(tiny):
    """Case api-max-tokens-edge: the engine never writes past max_seq_len."""
    engine = make_engine(tiny, max_seq_len=64)
    ids = prompts(tiny, 1)[0]
    outs = solo(engine, ids, SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True))
    assert outs[-1].finish_reason == "length"
    assert len(ids) + outs[-1].num_completion_tokens == 64


def test_stop_string_across_tokens_ends_generation_without_the_stop_text(tiny):
    """Case api-stop-across-tokens, at the engine."""
    engine = make_engine(tiny)
    ids = prompts(tiny, 1)[0]
    full_outs = solo(engine, ids)
    full = text(full_outs)
    pieces = [o.text for o in full_outs if o.text]
    # a stop string that spans the boundary between two emitted pieces
    joined, cut = "", None
    for a, b in zip(pieces, pieces[1:]):
        joined += a
        if a and b:
            cut = (len(joined), a[-1] + b[0])
            break
    assert cut is not None
    pos, stop = cut[0] - 1, cut[1]
    start = full.find(stop)
    outs = solo(engine, ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                            stop=(stop,)))
    assert outs[-1].finish_reason == "stop"
    assert text(outs) == full[:start]
    assert start <= pos
    assert_pools_back_to_baseline(engine)


def test_stop_token_id_ends_with_stop(tiny):
    engine, ids, greedy = engine_and_greedy_answer(tiny)
    target = greedy[5]
    outs = solo(engine, ids, stop_at(target))
    assert outs[-1].finish_reason == "stop"
    assert tokens(outs) == greedy[:greedy.index(target) + 1]


def test_prompt_beyond_the_plan_is_rejected_naming_the_numbers(tiny):
    """Case api-context-overflow, at the engine."""
    engine = make_engine(tiny, max_seq_len=64)
    with pytest.raises(RequestRejected, match="64 tokens.*64"):
        engine.add_request(GenerationRequest("long", list(range(64)), GREEDY))
    with pytest.raises(RequestRejected, match="empty"):
        engine.add_request(GenerationRequest("empty", [], GREEDY))
    with pytest.raises(RequestRejected, match="vocabulary"):
        engine.add_request(GenerationRequest("oov", [10**9], GREEDY))
    assert_pools_back_to_baseline(engine)


def test_engine_thread_serves_and_stops(tiny):
    import threading

    engine = make_engine(tiny)
    done = threading.Event()
    got = []

    def on_output(o):
        got.append(o)
        if o.finished:
            done.set()

    engine.on_output = on_output
    engine.start()
    try:
        engine.add_request(GenerationRequest("t", prompts(tiny, 1)[0], GREEDY))
        assert done.wait(60)
    finally:
        engine.stop()
    assert got[-1].finish_reason == "length" and got[-1].timings.first_token_ns is not None
    assert_pools_back_to_baseline(engine)


def test_text_held_back_for_a_possible_stop_string_is_sent_when_a_stop_token_ends(tiny):
    """A stop-string candidate at the end of the text must not be lost on EOS/stop token."""
    engine, ids, greedy = engine_and_greedy_answer(tiny)
    target = greedy[8]
    by_token = stop_at(target)
    expected = text(solo(engine, ids, by_token))
    assert expected
    # a stop string that begins with the text's last character but never completes
    held = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                          stop_token_ids=(target,), stop=(expected[-1] + "\x00\x01",))
    outs = solo(engine, ids, held)
    assert outs[-1].finish_reason == "stop"
    assert text(outs) == expected


class ForcedTokens:
    """A TokenConstraint that allows exactly one token at each step, then is done."""

    def __init__(self, forced: list[int]) -> None:
        self.forced, self.i = forced, 0

    def allowed(self, vocab_size: int):
        import torch

        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.forced[self.i]] = True
        return mask

    def advance(self, token_id: int) -> None:
        assert token_id == self.forced[self.i]
        self.i += 1

    def is_done(self) -> bool:
        return self.i == len(self.forced)


def test_token_constraint_masks_sampling_and_finishes_with_stop(tiny):
    engine = make_engine(tiny)
    forced = tiny.tokenizer.encode('{"a": 1}', add_special_tokens=False)
    req = GenerationRequest("c", prompts(tiny, 1)[0],
                            SamplingParams(max_tokens=50, temperature=1.0, seed=3),
                            constraint=ForcedTokens(forced))
    outs = engine.run_until_idle([req])["c"]
    assert tokens(outs) == forced and text(outs) == '{"a": 1}'
    assert outs[-1].finish_reason == "stop"
    assert_pools_back_to_baseline(engine)


def test_degenerate_sampling_values_never_fail_the_batch(tiny):
    """Break-it finding: temperature 1e-45 / top_p 1e-300 used to fail the whole step."""
    engine = make_engine(tiny)
    a, b = prompts(tiny, 2)
    bad = [SamplingParams(max_tokens=4, temperature=1e-45, ignore_eos=True),
           SamplingParams(max_tokens=4, temperature=1.0, top_p=1e-300, ignore_eos=True, seed=1)]
    greedy_a = tokens(solo(engine, a, SamplingParams(max_tokens=4, temperature=0,
                                                      ignore_eos=True)))
    for p in bad:
        outs = engine.run_until_idle([GenerationRequest("bad", a, p),
                                      GenerationRequest("ok", b, GREEDY)])
        assert outs["bad"][-1].finish_reason == "length"
        assert tokens(outs["bad"]) == greedy_a  # both are argmax in effect
        assert outs["ok"][-1].finish_reason == "length" and outs["ok"][-1].error is None
    with pytest.raises(ValueError, match="64-bit"):
        SamplingParams(seed=2**64)


class FailingConstraint(ForcedTokens):
    """ForcedTokens whose grammar gives up after `after` tokens (as GrammarConstraint
    does: only end-of-sequence allowed from then on, `is_done()` True, `error` set)."""

    def __init__(self, forced: list[int], after: int, eos: int) -> None:
        super().__init__(forced)
        self.after, self.eos, self.error = after, eos, None

    def allowed(self, vocab_size: int):
        if self.error is None:
            return super().allowed(vocab_size)
        import torch

        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.eos] = True
        return mask

    def advance(self, token_id: int) -> None:
        super().advance(token_id)
        if self.i == self.after:
            self.error = "Too many items (injected)"

    def is_done(self) -> bool:
        return self.error is not None or super().is_done()


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_failed_constraint_finishes_with_grammar_error_never_stop(tiny, ignore_eos):
    """Issue 23: a grammar failure mid-generation ended as "stop" with the cut output; it
    is "grammar_error", counted in grammar_failures_total (the cut tokens are still sent)."""
    engine = make_engine(tiny)
    forced = tiny.tokenizer.encode('{"a": [1, 2, 3]}', add_special_tokens=False)
    eos = tiny.tokenizer.eos_token_id
    req = GenerationRequest("g", prompts(tiny, 1)[0],
                            SamplingParams(max_tokens=50, temperature=0, ignore_eos=ignore_eos),
                            constraint=FailingConstraint(forced, 2, eos))
    outs = engine.run_until_idle([req])["g"]
    assert outs[-1].finish_reason == "grammar_error"
    assert tokens(outs)[:2] == forced[:2] and len(tokens(outs)) <= 3
    assert engine.stats()["grammar_failures_total"] == 1
    ok = GenerationRequest("ok", prompts(tiny, 1)[0],
                           SamplingParams(max_tokens=50, temperature=0),
                           constraint=ForcedTokens(forced))
    assert engine.run_until_idle([ok])["ok"][-1].finish_reason == "stop"
    assert engine.stats()["grammar_failures_total"] == 1
    assert_pools_back_to_baseline(engine)


def test_num_waiting_never_undercounts_while_the_inbox_drains(tiny):
    """The queue bound reads num_waiting from the event loop while the engine thread moves
    requests from the inbox to the scheduler: the count must never dip below the requests
    still queued (a dip lets a burst past --max-queue). The high-water mark is exact."""
    engine = make_engine(tiny)
    ps = prompts(tiny, 1)[0]
    reqs = [GenerationRequest(f"w{i}", ps, SamplingParams(max_tokens=1, temperature=0))
            for i in range(6)]
    for r in reqs:
        engine.add_request(r)
    assert engine.num_waiting == 6 and engine.stats()["num_waiting_peak"] == 6
    admitted = []
    real_admit = engine._admit

    def admit(req):  # while admitting: everything not yet running is still counted
        real_admit(req)
        admitted.append(engine.num_waiting)

    engine._admit = admit
    engine._drain_inbox()
    # in the scheduler before it leaves the inbox: counted twice for a moment (which only
    # makes the bound stricter), never fewer than the 6 not yet running
    assert len(admitted) == 6 and min(admitted) >= 6
    assert engine.num_waiting == 6
    engine.run_until_idle([])
    assert engine.num_waiting == 0 and engine.stats()["num_waiting_peak"] == 6
