"""The fixed-shape decode step (what serve captures as CUDA graphs), checked on CPU.

The runner is built with `capture=False`, so the very function a graph would capture runs
eagerly: its tokens must equal the eager engine's, padding rows must write only the KV
cache's padding page, decode steps that fit no bucket must fall back (and be counted),
and the pools' accounting must come back to zero. The capture itself needs a GPU
(bench/device_check.sh).
"""

from __future__ import annotations

import pytest
import torch

from flare.cli import build_parser
from flare.loading.checkpoint import load_checkpoint
from flare.models.attention import static_decode_attention
from flare.prepare.attention_tune import measure_decode_attention
from flare.prepare.package import _graph_bytes, graph_capture_for
from flare.package.reader import load_package
from flare.package.plan import layout_for, make_plan, memory_report
from flare.runtime.cuda_graphs import DecodeRunner, GraphPlan, pick_bucket, plan_buckets
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, SamplingParams
from flare.state.pools import KVCache

PS = 16


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_dir):
    return load_checkpoint(tiny_qwen3_dir)


def engine(ckpt, graphs: GraphPlan | None, prefix_cache: bool = True, **plan_kw) -> Engine:
    kw = {"max_seq_len": 256, "max_num_seqs": 4, "max_batch_tokens": 64, "page_size": PS,
          **plan_kw}
    return Engine(ckpt.config, make_plan(ckpt.config, **kw), ckpt.tensors, ckpt.tokenizer,
                  prefix_cache=prefix_cache, decode_graphs=graphs)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def prompts(n: int, length: int = 37) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(100, 40000, (length + 5 * i,), generator=gen).tolist()
            for i in range(n)]


def run_all(eng: Engine, ps: list[list[int]], n: int = 20) -> list[list[int]]:
    outs = eng.run_until_idle([GenerationRequest(str(i), p, greedy(n))
                               for i, p in enumerate(ps)])
    return [sum((o.token_ids for o in outs[str(i)]), []) for i in range(len(ps))]


def assert_pools_empty(eng: Engine) -> None:
    eng.check_integrity()
    assert not eng.scheduler.running and not eng.scheduler.waiting
    if eng.prefix_index is not None:
        eng.prefix_index.clear()
    assert eng.pool.num_used == 0


def fragment(eng: Engine) -> list[int]:
    """Leave the pool's free list in a scattered order (pages handed out afterwards are
    not consecutive): take every page, give back the odd ones, then the even ones."""
    pages = eng.pool.allocate(eng.pool.num_free)
    eng.pool.release(pages[1::2])
    eng.pool.release(pages[0::2])
    return pages


# ---- buckets -----------------------------------------------------------------------------


def test_plan_buckets_cover_the_plan():
    p = plan_buckets(max_num_seqs=6, pages_per_seq=512, page_size=16)
    assert p.batch_sizes == (1, 2, 4, 6)
    assert p.context_pages == (16, 64, 256, 512)  # 256 tokens, then 4x, then the plan
    assert plan_buckets(1, 3, 16).batch_sizes == (1,)
    assert plan_buckets(8, 3, 16).context_pages == (3,)
    assert plan_buckets(8, 3, 16).num_graphs == 4
    with pytest.raises(ValueError, match="must be >= 1"):
        plan_buckets(0, 3, 16)


def test_pick_bucket_is_the_smallest_that_fits():
    assert [pick_bucket((1, 2, 4, 8), n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


def test_graph_plan_round_trips_and_refuses_bad_entries():
    p = GraphPlan((1, 2, 4), (2, 8), "math")
    assert GraphPlan.from_manifest(p.to_manifest()) == p
    assert GraphPlan.from_manifest({"enabled": False, "reason": "x"}) is None
    with pytest.raises(ValueError, match="ascending"):
        GraphPlan((2, 1), (4,))
    with pytest.raises(ValueError, match="attention 'flash' unknown"):
        GraphPlan((1,), (4,), "flash")
    with pytest.raises(ValueError, match="unreadable"):
        GraphPlan.from_manifest({"enabled": True, "batch_sizes": [1]})


def test_runner_bucket_choice_and_its_refusals(tiny):
    eng = engine(tiny, GraphPlan((1, 2, 4), (2, 8)))
    r = eng.decoder
    assert r.bucket_for(1, 1) == (1, 2)
    assert r.bucket_for(3, 33) == (4, 8)  # 33 tokens: 3 pages -> the 8-page bucket
    assert r.bucket_for(5, 10) is None and r.bucket_for(1, 8 * PS + 1) is None
    with pytest.raises(ValueError, match="padding page"):
        DecodeRunner(eng.model, KVCache(eng.layout, 4, "cpu"), GraphPlan((1,), (1,)))
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA KV cache"):
        DecodeRunner(eng.model, eng.kv, GraphPlan((1,), (1,)), capture=True)
    with pytest.raises(RuntimeError, match="capture=False"):
        r.capture_all()
    assert r.num_graphs == 0


# ---- token equality with the eager engine --------------------------------------------------


@pytest.mark.parametrize("n_seqs", [1, 3, 4])
def test_static_decode_tokens_equal_eager(tiny, n_seqs):
    """Batches of 1, 3 (one padding row) and 4, each sequence over several pages,
    non-consecutive ones (a fragmented pool), two context buckets crossed on the way."""
    ps = prompts(n_seqs)
    want = run_all(engine(tiny, None, prefix_cache=False), ps, 30)
    eng = engine(tiny, GraphPlan((1, 2, 4), (3, 16)), prefix_cache=False)
    fragment(eng)
    got = run_all(eng, ps, 30)
    assert got == want
    s = eng.stats()
    assert s["decode_static_eager_total"] >= 29 - n_seqs  # every pure decode step
    assert s["decode_graph_replays_total"] == 0 and s["decode_graph_fallbacks_total"] == 0
    assert s["eager_steps_total"] >= 1  # the prefills
    assert_pools_empty(eng)


def test_static_decode_in_two_buckets_equals_eager_with_arrivals(tiny):
    """Requests arriving while others decode: mixed steps go eager, pure decode steps
    static, batch sizes change from step to step."""
    ps = prompts(4, length=20)
    want = run_all(engine(tiny, None), ps, 24)
    eng = engine(tiny, GraphPlan((1, 2, 4), (16,)))
    got: dict[str, list[int]] = {str(i): [] for i in range(4)}
    eng.on_output = lambda o: got[o.request_id].extend(o.token_ids)
    for i, p in enumerate(ps):
        eng.add_request(GenerationRequest(str(i), p, greedy(24)))
        for _ in range(3 + 2 * i):
            eng.step()
    while eng.scheduler.has_work():
        eng.step()
    assert [got[str(i)] for i in range(4)] == want
    assert eng.stats()["decode_static_eager_total"] > 0
    assert_pools_empty(eng)


def test_reuse_with_static_decode_equals_recompute(tiny):
    """A second turn that reuses the first turn's pages gives the tokens a cold engine
    computes from scratch."""
    first = prompts(1, length=40)[0]
    warm = engine(tiny, GraphPlan((1, 2, 4), (16,)))
    turn1 = run_all(warm, [first], 12)[0]
    second = first + turn1 + prompts(1, length=9)[0]
    reused = run_all(warm, [second], 16)[0]
    assert warm.reuse_counters.reused_tokens >= 48  # three full pages at least
    cold = engine(tiny, None, prefix_cache=False)
    assert reused == run_all(cold, [second], 16)[0]
    assert_pools_empty(warm)


def test_batches_above_the_largest_bucket_fall_back_to_eager(tiny):
    ps = prompts(4, length=12)
    want = run_all(engine(tiny, None), ps, 12)
    eng = engine(tiny, GraphPlan((1, 2), (2,)))  # batch > 2 or context > 32: eager
    assert run_all(eng, ps, 12) == want
    s = eng.stats()
    assert s["decode_graph_fallbacks_total"] > 0
    assert s["decode_static_eager_total"] == 0  # all four decode together, always > 2
    fallbacks = eng.stats()["decode_graph_fallbacks_total"]
    long = run_all(eng, [prompts(1, length=30)[0]], 8)  # decode contexts of 31..37 tokens
    assert eng.stats()["decode_static_eager_total"] == 2  # 31 and 32 fit the 2 pages
    assert eng.stats()["decode_graph_fallbacks_total"] == fallbacks + 5
    assert long == run_all(engine(tiny, None), [prompts(1, length=30)[0]], 8)
    assert_pools_empty(eng)


# ---- padding -----------------------------------------------------------------------------


def test_padding_rows_write_only_the_padding_page(tiny):
    eng = engine(tiny, GraphPlan((4,), (4,)), prefix_cache=False)
    gen = torch.Generator().manual_seed(3)
    eng.kv.k.copy_(torch.randn(eng.kv.k.shape, generator=gen))  # finite, recognisable
    eng.kv.v.copy_(torch.randn(eng.kv.v.shape, generator=gen))
    pages = eng.pool.allocate(2)
    length = PS + 5  # position 20: page 1, offset 4
    slot = pages[1] * PS + 4
    k0, v0 = eng.kv.k.clone(), eng.kv.v.clone()
    logits = eng.decoder.run([1234], [length - 1], [slot], [pages], [length])
    assert logits.shape == (1, tiny.config.vocab_size)
    pad = eng.kv.padding_page
    changed = (eng.kv.k != k0).any(-1).any(-1).any(0)  # [slots]: written in any layer
    changed |= (eng.kv.v != v0).any(-1).any(-1).any(0)
    written = changed.nonzero().flatten().tolist()
    assert slot in written
    assert set(written) - {slot} <= set(range(pad * PS, (pad + 1) * PS))
    assert set(written) - {slot}  # the three padding rows wrote (into the padding page)
    real = torch.ones(eng.kv.k.shape[1], dtype=torch.bool)
    real[slot] = False
    real[pad * PS:] = False
    assert torch.equal(eng.kv.k[:, real], k0[:, real])
    assert torch.equal(eng.kv.v[:, real], v0[:, real])
    eng.pool.release(pages)
    assert eng.pool.num_used == 0


def test_padding_page_is_outside_the_pool(tiny):
    with_graphs = engine(tiny, GraphPlan((1, 2), (16,)))
    without = engine(tiny, None)
    assert without.kv.padding_page is None
    assert with_graphs.kv.padding_page == with_graphs.pool.num_pages == without.pool.num_pages
    assert with_graphs.kv.nbytes - without.kv.nbytes == with_graphs.layout.bytes_per_page
    taken = with_graphs.pool.allocate(with_graphs.pool.num_pages)  # the whole pool
    assert with_graphs.kv.padding_page not in taken
    with_graphs.pool.release(taken)
    assert_pools_empty(with_graphs)


def test_static_attention_kinds_agree_and_refuse_unknown():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(64, 2, 8, generator=gen)
    v = torch.randn(64, 2, 8, generator=gen)
    q = torch.randn(3, 4, 8, generator=gen)
    gather = torch.arange(48).view(3, 16).flip(1)
    mask = (torch.arange(16)[None, :] < torch.tensor([16, 5, 1])[:, None])[:, None, None, :]
    a = static_decode_attention(q, k, v, gather, mask, 0.35, "sdpa")
    b = static_decode_attention(q, k, v, gather, mask, 0.35, "math")
    assert a.shape == (3, 4, 8)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # a row of length 1 attends to its first slot only: the output is that V
    torch.testing.assert_close(a[2], v[gather[2, 0]].repeat_interleave(2, 0))
    with pytest.raises(ValueError, match="unknown"):
        static_decode_attention(q, k, v, gather, mask, 0.35, "flash")


# ---- prepare: plan and manifest ------------------------------------------------------------


def test_graph_capture_plan_by_device_and_recipe(tiny):
    plan = make_plan(tiny.config, max_seq_len=1024, max_num_seqs=8)
    assert graph_capture_for("cpu", plan) == {"enabled": False,
                                              "reason": "CPU: CUDA graphs do not apply"}
    cuda = graph_capture_for("cuda", plan, "llama", "math")
    assert cuda == {"enabled": True, "batch_sizes": [1, 2, 4, 8],
                    "context_pages": [16, 64], "attention": "math"}
    hybrid = graph_capture_for("cuda", plan, "qwen3_5")
    assert hybrid["enabled"] is False and "hybrid" in hybrid["reason"]
    with pytest.raises(ValueError, match="capacity plan"):
        graph_capture_for("cuda:0", None)


def test_memory_report_counts_the_graphs_in_the_workspace(tiny):
    plan = make_plan(tiny.config, max_seq_len=256, max_num_seqs=4)
    layout = layout_for(tiny.config, plan)
    capture = graph_capture_for("cuda", plan)
    extra = _graph_bytes(capture, layout, tiny.config.vocab_size)
    assert extra > layout.bytes_per_page  # padding page, gathered K/V, logits
    assert _graph_bytes({"enabled": False}, layout, tiny.config.vocab_size) == 0
    base = memory_report(tiny.config, plan, 1000, 1 << 40)
    with_graphs = memory_report(tiny.config, plan, 1000, 1 << 40, graph_bytes=extra)
    assert with_graphs.workspace_bytes == base.workspace_bytes + extra
    assert with_graphs.total_bytes == base.total_bytes + extra
    assert with_graphs.graph_workspace_bytes == extra and base.graph_workspace_bytes == 0


def test_cpu_package_records_no_capture_and_cpu_serving_ignores_a_plan(tiny_qwen3_package):
    loaded = load_package(tiny_qwen3_package)
    m = loaded.manifest
    assert m.graph_capture == {"enabled": False, "reason": "CPU: CUDA graphs do not apply"}
    assert "decode_attention" not in m.tuning and m.memory["graph_workspace_bytes"] == 0
    loaded.manifest = m.model_copy(update={"graph_capture": GraphPlan((1, 2), (4,))
                                           .to_manifest()})
    eng = Engine.from_package(loaded)
    assert eng.decoder is None and eng.kv.padding_page is None  # graphs are CUDA-only


def test_measure_decode_attention_on_cpu():
    out = measure_decode_attention(num_seqs=3, tokens=40, num_heads=4, num_kv_heads=2,
                                   head_dim=8, page_size=16, dtype=torch.float32,
                                   device="cpu", iters=3)
    assert out["choice"] in ("sdpa", "math") and set(out["us"]) == {"sdpa", "math"}
    assert all(v > 0 for v in out["us"].values())
    assert out["shape"]["tokens"] == 40 and out["flashinfer_served"] is False
    assert "error" in out["flashinfer"]
    with pytest.raises(ValueError, match="multiple"):
        measure_decode_attention(num_seqs=1, tokens=4, num_heads=3, num_kv_heads=2,
                                 head_dim=8, page_size=4, dtype=torch.float32, device="cpu")


# ---- flags ---------------------------------------------------------------------------------


def test_device_and_graph_flags():
    parser = build_parser()
    args = parser.parse_args(["serve", "pkg", "--device", "cuda:1", "--no-cuda-graphs"])
    assert args.device == "cuda:1" and args.no_cuda_graphs is True
    args = parser.parse_args(["serve", "pkg"])
    assert args.device == "cpu" and args.no_cuda_graphs is False
    assert parser.parse_args(["prepare", "m", "--out", "o", "--device", "cuda"]).device == "cuda"
    for bad in ("gpu", "cpu:0", "cuda:x"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "pkg", "--device", bad])


def test_hybrid_recipes_have_no_static_decode(tmp_path, embedded_checkpoint):
    from hybrid_models import save_tiny_lfm2

    save_tiny_lfm2(tmp_path / "lfm2", embedded_checkpoint.tokenizer)
    ckpt = load_checkpoint(tmp_path / "lfm2")
    with pytest.raises(ValueError, match="hybrid recipes decode eagerly"):
        engine(ckpt, GraphPlan((1,), (4,)), max_seq_len=64)
