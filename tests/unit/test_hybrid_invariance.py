"""Exact by default, for the hybrid recipes (Qwen3.5, LFM2, Qwen3-Next): a token's fp32
logits are `torch.equal` whether it is computed in one prefill, in chunks of 1, 7, 16 or
64 tokens, after reuse of a saved state, or beside 3 or 7 other sequences of other lengths.

Three layers of checks, on the tiny random models of `hybrid_models`:
- the row ops (norms, activations, RoPE, the router's softmax/top-k): row i of a call on
  [T, ...] equals the call on row i alone, for several T and widths;
- the model through `hybrid_driver.Runner` with every linear layer run one row at a time
  and attention one query at a time (both exact by construction), which isolates
  everything else (conv, gated delta rule, norms, gates, MoE routing);
- the engine end to end (its sampled rows of fp32 logits recorded), which also needs the
  row-invariant `flare.models.quant.linear.Linear` kernel and the fixed-order fused attention.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from flare.models import hybrid_common as hc
from flare.models import hybrid_decoder
from flare.models.quant.linear import Linear
from flare.models.gated_delta import l2norm
from flare.package.plan import layout_for
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest
from engine_helpers import greedy, words
from hybrid_models import tiny_hybrid_fixture

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "parity"))
from hybrid_driver import Runner  # noqa: E402

CHUNKS = (1, 7, 16, 64, None)  # None: the whole prompt in one step
NEW = 6


# ---- the row ops --------------------------------------------------------------------------

ROW_OPS = {
    "rms_norm": lambda x: hc.rms_norm(x, torch.linspace(0.5, 1.5, x.shape[-1]), 1e-6),
    "rms_norm_offset": lambda x: hc.rms_norm_offset(x, torch.linspace(-.5, .5, x.shape[-1]),
                                                    1e-6),
    "l2norm": l2norm,
    "sigmoid": hc.sigmoid,
    "silu": hc.silu,
    "softplus": hc.softplus,
    "softmax_topk": lambda x: x.softmax(-1, dtype=torch.float32).topk(2, dim=-1).values,
    "topk_renorm": lambda x: (lambda w: w / w.sum(-1, keepdim=True))(
        x.softmax(-1).topk(2, dim=-1).values),
}


@pytest.mark.parametrize("name", sorted(ROW_OPS))
@pytest.mark.parametrize("width", [4, 12, 64, 100, 1000])
def test_row_ops_give_each_row_what_it_gets_alone(name, width):
    fn = ROW_OPS[name]
    gen = torch.Generator().manual_seed(width)
    for t in (1, 7, 64, 300):  # 300 x 1000: big enough for torch to split over threads
        x = torch.randn(t, width, generator=gen) * 4
        y = fn(x)
        for i in range(t):
            assert torch.equal(y[i:i + 1], fn(x[i:i + 1])), (t, i)
        x3 = x.view(t, 2, width // 2) if width % 2 == 0 else None
        if x3 is not None and name not in ("softmax_topk", "topk_renorm"):
            y3 = fn(x3)
            assert all(torch.equal(y3[i:i + 1], fn(x3[i:i + 1])) for i in range(t))


def test_activations_match_torch_within_rounding():
    x = torch.linspace(-30, 30, 10001)
    torch.testing.assert_close(hc.sigmoid(x), torch.sigmoid(x), atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(hc.silu(x), torch.nn.functional.silu(x), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(hc.softplus(x), torch.nn.functional.softplus(x), atol=1e-6,
                               rtol=1e-6)


def test_rope_gives_each_row_what_it_gets_alone():
    cos, sin = hc.rope_tables(10000.0, 8, 64, torch.float32, torch.device("cpu"))
    x = torch.randn(50, 3, 16)
    pos = torch.randint(0, 64, (50,))
    y = hc.apply_rope(x, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
    for i in range(50):
        alone = hc.apply_rope(x[i:i + 1], cos[pos[i:i + 1]].unsqueeze(1),
                              sin[pos[i:i + 1]].unsqueeze(1))
        assert torch.equal(y[i:i + 1], alone)


# ---- fixtures -----------------------------------------------------------------------------

tiny = tiny_hybrid_fixture("hybrid-exact", ("qwen3_5", "lfm2", "qwen3_next"),
                           max_num_seqs=8, checkpoint_interval=32)


def make_engine(tiny, prefix_cache: bool = False, **plan_changes) -> Engine:
    pkg = tiny.package
    plan = dataclasses.replace(pkg.plan, **plan_changes)
    return Engine(pkg.config, plan, pkg.tensors, pkg.tokenizer,
                  namespace=pkg.manifest.package_id, prefix_cache=prefix_cache)


# ---- the model with exact linear layers and attention (isolates the rest) ---------------

def _token_attention(q, k_cache, v_cache, batch, scale, ops=None):
    """Attention one query at a time, each over its own keys in a call of its own shape
    (so exact whatever the batch): a reference for isolating the other ops."""
    out = torch.empty_like(q)
    h, kvh = q.shape[1], k_cache.shape[1]
    rows = []
    dec = batch.decode
    if dec is not None:
        for b in range(dec.num_seqs):
            if dec.lengths is not None:
                n = int(dec.lengths[b])
            elif dec.mask is not None:
                n = int(dec.mask[b, 0, 0].sum())
            else:
                n = dec.gather.shape[1]
            rows.append((b, dec.gather[b, :n]))
    for chunk in batch.prefills:
        ctx = chunk.gather.shape[0]
        for j in range(chunk.length):
            rows.append((chunk.start + j, chunk.gather[:ctx - chunk.length + j + 1]))
    for i, slots in rows:
        k = k_cache[slots].repeat_interleave(h // kvh, dim=1)  # [L, H, D]
        v = v_cache[slots].repeat_interleave(h // kvh, dim=1)
        p = (torch.einsum("hd,lhd->hl", q[i], k) * scale).softmax(-1)
        out[i] = torch.einsum("hl,lhd->hd", p, v)
    return out


@pytest.fixture
def exact_linear_and_attention(monkeypatch):
    call = Linear.__call__

    def rowwise(self, x):
        return torch.cat([call(self, x[i:i + 1]) for i in range(x.shape[0])])

    monkeypatch.setattr(Linear, "__call__", rowwise)
    monkeypatch.setattr(hybrid_decoder, "paged_attention", _token_attention)


def _runner(tiny) -> Runner:
    engine = make_engine(tiny)
    return Runner(engine.model, layout_for(tiny.package.config, tiny.package.plan),
                  num_pages=128, num_slots=12)


def _states(runner: Runner, seq) -> dict[str, torch.Tensor]:
    return runner.states.read(seq.slot)


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _mixed(runner: Runner, prompts: list[list[int]], chunks: list[int], n_new: int):
    """All `prompts` at once: each step decodes the sequences past their prompt and takes
    the next chunk (chunks[i] tokens) of every sequence still prefilling."""
    seqs = [runner.new_seq(p) for p in prompts]
    while any(s.generated < n_new for s in seqs):
        dec = [s for s in seqs if 0 < s.generated < n_new]
        pre = [(s, min(c, len(s.tokens) - s.computed))
               for s, c in zip(seqs, chunks) if s.generated == 0]
        rows = runner.step(dec, pre)
        for s, row in zip(dec + [s for s, _ in pre], rows):
            if s.computed == len(s.tokens):
                runner._sample(s, row)
    return seqs


def test_model_exact_across_chunkings(tiny, exact_linear_and_attention):
    runner = _runner(tiny)
    prompt = words(100, seed=21)
    ref = runner.generate(prompt, NEW)
    for chunk in CHUNKS[:-1]:
        seq = runner.generate(prompt, NEW, chunk=chunk)
        assert seq.tokens == ref.tokens
        assert all(torch.equal(a, b) for a, b in zip(seq.logits, ref.logits)), chunk
        _assert_same(_states(runner, seq), _states(runner, ref))
        runner.free(seq)


@pytest.mark.parametrize("others", [3, 7])
def test_model_exact_beside_other_sequences(tiny, exact_linear_and_attention, others):
    runner = _runner(tiny)
    prompt = words(90, seed=31)
    alone = runner.generate(prompt, NEW)
    lengths = [13, 40, 77, 120, 5, 61, 33][:others]
    prompts = [prompt] + [words(n, seed=40 + n) for n in lengths]
    seqs = _mixed(runner, prompts, [16, 5, 9, 23, 3, 64, 7, 11][:others + 1], NEW)
    assert seqs[0].tokens == alone.tokens
    assert all(torch.equal(a, b) for a, b in zip(seqs[0].logits, alone.logits))
    _assert_same(_states(runner, seqs[0]), _states(runner, alone))


def test_model_exact_after_a_copied_state(tiny, exact_linear_and_attention):
    runner = _runner(tiny)
    prompt = words(70, seed=51)
    ref = runner.generate(prompt, NEW + 4)
    seq = runner.new_seq(prompt)
    runner.prefill(seq, chunk=7)
    runner.decode([seq], 3)
    child = runner.fork(seq)  # the saved state at position 73, KV pages shared
    child.logits = list(seq.logits)
    runner.free(seq)
    runner.decode([child], NEW + 4 - child.generated)
    assert child.tokens == ref.tokens
    assert all(torch.equal(a, b) for a, b in zip(child.logits, ref.logits))


# ---- the engine end to end -----------------------------------------------------------------

def _record(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """Every sampled row of fp32 logits, per request id, in order."""
    got: dict[str, list[torch.Tensor]] = defaultdict(list)
    sample = engine._sample

    def spy(sampling, logits):
        for row, seq in enumerate(sampling):
            got[seq.request_id].append(logits[row].clone())
        return sample(sampling, logits)

    engine._sample = spy
    return got


def _logits(engine: Engine, prompts: dict[str, list[int]], n: int = NEW):
    got = _record(engine)
    engine.run_until_idle([GenerationRequest(r, p, greedy(n)) for r, p in prompts.items()])
    return got


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_engine_logits_equal_across_chunk_sizes(tiny):
    prompt = words(100, seed=21)
    ref = _logits(make_engine(tiny, max_batch_tokens=512), {"r": prompt})["r"]
    for chunk in CHUNKS[:-1]:
        got = _logits(make_engine(tiny, max_batch_tokens=chunk), {"r": prompt})["r"]
        assert _equal(got, ref), f"chunks of {chunk}"


@pytest.mark.parametrize("others", [3, 7])
def test_engine_logits_equal_alone_and_batched(tiny, others):
    prompt = words(90, seed=31)
    ref = _logits(make_engine(tiny, max_batch_tokens=64), {"t": prompt})["t"]
    lengths = [13, 40, 77, 120, 5, 61, 33][:others]
    batch = {"t": prompt} | {f"o{n}": words(n, seed=40 + n) for n in lengths}
    got = _logits(make_engine(tiny, max_batch_tokens=64), batch)
    assert _equal(got["t"], ref)
    alone = _logits(make_engine(tiny, max_batch_tokens=64), {"o40": batch["o40"]})["o40"]
    assert _equal(got["o40"], alone)


def test_engine_logits_equal_after_reuse(tiny):
    """A saved endpoint state (the end of turn 1) and a grid checkpoint (position 64 of a
    150-token prompt) reused: the logits equal a cold engine's recompute."""
    warm, cold = make_engine(tiny, prefix_cache=True), make_engine(tiny)
    turn1 = words(37, seed=3)
    outs = warm.run_until_idle([GenerationRequest("a", turn1, greedy(20))])
    turn2 = turn1 + sum((o.token_ids for o in outs["a"]), []) + words(11, seed=4)
    got = _record(warm)
    outs = warm.run_until_idle([GenerationRequest("b", turn2, greedy(NEW))])
    assert outs["b"][-1].num_cached_tokens > len(turn1)
    assert _equal(got["b"], _logits(cold, {"b": turn2})["b"])
    base = words(150, seed=1)
    warm.run_until_idle([GenerationRequest("c", base, greedy(2))])
    ids = base[:70] + words(9, seed=2)
    got = _record(warm)
    outs = warm.run_until_idle([GenerationRequest("d", ids, greedy(NEW))])
    assert outs["d"][-1].num_cached_tokens == 64
    assert _equal(got["d"], _logits(cold, {"d": ids})["d"])
