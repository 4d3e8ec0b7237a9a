"""A float16 KV pool under float32 serving (the plan's `kv_dtype`).

The kernels widen each stored element exactly, so a float16 cache must give bit for bit
what the float32 kernels give on that cache widened; the engine's exactness properties
(chunking, reuse at any position, batch neighbours) must hold unchanged; and the
next-token distributions may differ from a float32 pool's only by the cache's rounding
(stated bounds against the float32 reference).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from engine_helpers import position_logits, words
from exactness import check_batch_neighbours, check_chunkings, check_reuse_positions
from hybrid_models import PAGE as HYBRID_PAGE, tiny_hybrid_fixture
from flare.cli import build_parser
from flare.models.attention import AttentionBatch, DecodeGroup, PrefillChunk, paged_attention
from flare.models.quant.formats import default_kv_dtype, default_weight_format
from flare.models.quant.storage import convert_tensors
from flare.package.contract import read_manifest
from flare.package.plan import CapacityPlan, layout_for, make_plan, memory_report
from flare.prepare.package import reuse_problem
from flare.runtime.engine import Engine

kernels = pytest.importorskip("flare.kernels")
OPS = kernels.fused_ops()
needs_ops = pytest.mark.skipif(OPS is None, reason="Flare's kernel module is unavailable")

PAGE = 16


def _cache(s: int, kvh: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(s, kvh, d, generator=g) * 3).half(),
            torch.randn(s, kvh, d, generator=g).half())


@needs_ops
@pytest.mark.parametrize("d", [64, 12])  # 12: the scalar path (D not a multiple of 8)
@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
def test_attention_on_a_float16_cache_equals_the_float32_kernel_on_it_widened(d, heads):
    h, kvh = heads
    s, ctx, rows = 700, 333, 37
    kc, vc = _cache(s, kvh, d, seed=d + h)
    k32, v32 = kc.float(), vc.float()
    g = torch.Generator().manual_seed(1)
    gather = torch.randperm(s, generator=g)[:ctx].reshape(1, ctx).contiguous()
    scale = 1 / math.sqrt(d)
    # a prefill chunk, each row causal
    q = torch.randn(rows, h, d, generator=g)
    lengths = torch.tensor([ctx])
    assert torch.equal(OPS.cached_attention(q, kc, vc, gather, lengths, rows, scale),
                       OPS.cached_attention(q, k32, v32, gather, lengths, rows, scale))
    # decode: several sequences of different lengths, and one over consecutive slots
    gathers = torch.stack([torch.randperm(s, generator=g)[:ctx] for _ in range(3)])
    lens = torch.tensor([ctx, 5, 120])
    qd = torch.randn(3, h, d, generator=g)
    assert torch.equal(OPS.decode_attention_gather(qd, kc, vc, gathers, lens, scale),
                       OPS.decode_attention_gather(qd, k32, v32, gathers, lens, scale))
    assert torch.equal(OPS.decode_attention(qd[0], kc, vc, 17, ctx, scale),
                       OPS.decode_attention(qd[0], k32, v32, 17, ctx, scale))


@needs_ops
@pytest.mark.parametrize("heads", [(9, 3), (8, 2), (12, 2), (5, 5)])  # G = 3, 4, 6, 1
def test_decode_rows_on_a_float16_cache_equal_its_prefill_rows(heads):
    """A decode tile (one position's G query heads) reads the float16 cache as it goes,
    a prefill tile of many rows reads a widened copy of each key block (G = 6 decodes
    that way too), and a chunk of 5 rows at G = 3 ends its tile on 3 rows: every path
    gives a row the same bits."""
    h, kvh = heads
    s, n, d = 600, 230, 64
    kc, vc = _cache(s, kvh, d, seed=h)
    g = torch.Generator().manual_seed(h + 1)
    gather = torch.randperm(s, generator=g)[:n].contiguous()
    q = torch.randn(n, h, d, generator=g)
    scale = 1 / math.sqrt(d)
    whole = OPS.cached_attention(q, kc, vc, gather.view(1, -1), torch.tensor([n]), n, scale)
    for p in (0, 7, 64, 65, 150, n - 1):
        alone = OPS.decode_attention_gather(q[p:p + 1].contiguous(), kc, vc,
                                            gather[:p + 1].contiguous().view(1, -1),
                                            torch.tensor([p + 1]), scale)
        assert torch.equal(alone[0], whole[p]), p
    chunk = OPS.cached_attention(q[100:105].contiguous(), kc, vc,
                                 gather[:105].contiguous().view(1, -1), torch.tensor([105]),
                                 5, scale)
    assert torch.equal(chunk, whole[100:105])


@needs_ops
def test_attention_refuses_mixed_or_other_cache_dtypes():
    kc, vc = _cache(8, 1, 16, seed=0)
    q = torch.randn(1, 16)
    with pytest.raises(RuntimeError, match="one dtype"):
        OPS.decode_attention(q, kc, vc.float(), 0, 4, 0.25)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        OPS.decode_attention(q, kc.bfloat16(), vc.bfloat16(), 0, 4, 0.25)


@needs_ops
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("d", [64, 12])
def test_rope_store_into_a_float16_cache_rounds_as_torch_does(qk_norm, d):
    """The same q as with a float32 cache, and the float32 cache's rows rounded to nearest
    even (torch's .to(float16)) in the float16 one; other slots untouched."""
    torch.manual_seed(d)
    h, kvh, s, p, t = 9, 3, 64, 100, 5
    qkv = torch.randn(t, (h + 2 * kvh) * d) * 4
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(torch.arange(p).float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos(), torch.cat([-emb.sin()[:, :d // 2], emb.sin()[:, d // 2:]], dim=-1)
    pos, slots = torch.randint(0, p, (t,)), torch.randperm(s)[:t]
    norm = torch.rand(h + kvh, d) + 0.5 if qk_norm else None
    k32, v32 = torch.zeros(s, kvh, d), torch.zeros(s, kvh, d)
    k16, v16 = torch.full((s, kvh, d), 7.0).half(), torch.full((s, kvh, d), 7.0).half()
    q32 = OPS.rope_store(qkv, cos, sin, pos, k32, v32, slots, h, kvh, norm, 1e-6)
    q16 = OPS.rope_store(qkv, cos, sin, pos, k16, v16, slots, h, kvh, norm, 1e-6)
    assert torch.equal(q16, q32)
    assert torch.equal(k16[slots], k32[slots].half())
    assert torch.equal(v16[slots], v32[slots].half())
    others = torch.ones(s, dtype=torch.bool)
    others[slots] = False
    assert bool((k16[others] == 7.0).all()) and bool((v16[others] == 7.0).all())


@needs_ops
def test_paged_attention_torch_path_reads_a_float16_cache():
    """Without the kernels (ops=None) the torch path widens the rows it reads: close to
    the fused result on the same float16 cache (SDPA's order differs, not its inputs)."""
    h, kvh, d, s = 9, 3, 64, 256
    kc, vc = _cache(s, kvh, d, seed=5)
    g = torch.Generator().manual_seed(2)
    ctx, rows = 100, 10
    gather = torch.randperm(s, generator=g)[:ctx]
    mask = torch.ones(rows, ctx, dtype=torch.bool).tril(ctx - rows)
    q = torch.randn(1 + rows, h, d, generator=g)
    dec_gather = torch.randperm(s, generator=g)[:40].reshape(1, 40)
    batch = AttentionBatch(
        slot_mapping=torch.zeros(1 + rows, dtype=torch.int64),
        decode=DecodeGroup(num_seqs=1, gather=dec_gather, mask=None,
                           lengths=torch.tensor([40])),
        prefills=(PrefillChunk(start=1, length=rows, gather=gather, mask=mask),))
    fused = paged_attention(q, kc, vc, batch, d ** -0.5, OPS)
    plain = paged_attention(q, kc, vc, batch, d ** -0.5, None)
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain, fused, rtol=1e-5, atol=1e-5)


def test_plan_kv_dtype_sizes_the_pool_and_keeps_old_manifests(embedded_checkpoint):
    c = embedded_checkpoint.config
    p32 = make_plan(c, max_seq_len=256, max_num_seqs=2)
    p16 = make_plan(c, max_seq_len=256, max_num_seqs=2, kv_dtype="float16")
    assert layout_for(c, p16).dtype == torch.float16
    assert layout_for(c, p32).dtype == torch.float32
    r32, r16 = (memory_report(c, p, 1000, 1 << 40) for p in (p32, p16))
    assert r16.kv_pool_bytes * 2 == r32.kv_pool_bytes
    assert r16.workspace_bytes == r32.workspace_bytes  # activations stay float32
    # a pool in the serving dtype writes the manifest's plan as before, and reads it back
    assert "kv_dtype" not in p32.to_dict()
    assert make_plan(c, max_seq_len=256, kv_dtype="float32").kv_dtype is None
    assert CapacityPlan.from_dict(p16.to_dict()) == p16
    with pytest.raises(ValueError, match="kv_dtype 'int4' unknown"):
        make_plan(c, max_seq_len=256, kv_dtype="int4")
    args = build_parser().parse_args(["prepare", "embedded", "--out", "x",
                                      "--kv-dtype", "float16"])
    assert args.kv_dtype == "float16"


@pytest.mark.parametrize("fmt, dtype, device, want", [
    ("q4x8", "float32", "cpu", "float16"), ("q8x8", "float32", "cpu", "float16"),
    ("kx8", "float32", "cpu", "float16"), ("fp16", "float32", "cpu", None),
    ("full", "float32", "cpu", None), ("full", "bfloat16", "cpu", None),
    ("q4x8", "float32", "cuda", None)])
def test_default_kv_dtype_is_float16_for_the_int8_formats_alone(fmt, dtype, device, want):
    assert default_kv_dtype(fmt, dtype=dtype, device=device) == want


def test_a_default_package_of_the_embedded_model_has_a_float16_pool(smollm2_package,
                                                                    embedded_gguf):
    m = read_manifest(smollm2_package)
    assert m.tuning["weights"] == "q4x8"
    assert m.plan["kv_dtype"] == "float16" and m.state_layout["dtype"] == "float16"
    plan = CapacityPlan.from_dict(m.plan)
    assert m.memory["kv_pool_bytes"] == plan.num_pages * plan.page_size * 2 * 30 * 3 * 64 * 2
    # the same settings reuse it (no rebuild); asking for a float32 pool does not
    same = {"max_seq_len": 2048, "max_num_seqs": 8, "page_size": 16}
    assert reuse_problem(smollm2_package, embedded_gguf, **same) is None
    assert reuse_problem(smollm2_package, embedded_gguf, kv_dtype="float16", **same) is None
    assert "plan differs" in reuse_problem(smollm2_package, embedded_gguf,
                                           kv_dtype="float32", **same)


def _maker(ckpt, kv_dtype: str | None = "float16"):
    fmt = default_weight_format(dtype="float32", device="cpu", recipe="llama",
                                source=ckpt.source)
    stored = convert_tensors(ckpt.tensors, fmt)

    def make(max_batch_tokens: int, max_num_seqs: int) -> Engine:
        plan = make_plan(ckpt.config, max_seq_len=256, max_num_seqs=max_num_seqs,
                         max_batch_tokens=max_batch_tokens, page_size=PAGE,
                         kv_dtype=kv_dtype)
        return Engine(ckpt.config, plan, stored, ckpt.tokenizer)

    return make


PROMPT = words(70, seed=3)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def make16(embedded_checkpoint):
    return _maker(embedded_checkpoint)


@needs_ops
def test_float16_pool_logits_equal_across_chunk_sizes(make16):
    assert make16(64, 1).kv.k.dtype == torch.float16
    check_chunkings(make16, PROMPT, NEW_TOKENS)


@needs_ops
def test_float16_pool_logits_equal_after_reuse_at_any_position(make16):
    check_reuse_positions(make16, PROMPT, NEW_TOKENS, PAGE)


@needs_ops
def test_float16_pool_logits_equal_alone_and_beside_other_sequences(make16):
    check_batch_neighbours(make16, PROMPT, NEW_TOKENS)


def _corpus_ids(tokenizer, n: int) -> list[int]:
    """The first n tokens of the agent-session corpus (a file that never changes: a new
    version is a new file), as plain text: a real conversation, not random tokens."""
    corpus = json.loads((Path(__file__).parents[2] / "corpus" / "agent-sessions-v1.json")
                        .read_text())
    text = corpus["system"] + "\n".join(
        m["content"] for m in corpus["sessions"][0]["messages"])
    return tokenizer.encode(text)[:n]


def _teacher_forced(ckpt, fmt: str, kv_dtype: str | None, ids: list[int]) -> torch.Tensor:
    """log-softmax [len(ids), vocab] of one prefill of `ids`, weights in `fmt`."""
    plan = make_plan(ckpt.config, max_seq_len=512, max_num_seqs=1, kv_dtype=kv_dtype)
    engine = Engine(ckpt.config, plan, convert_tensors(ckpt.tensors, fmt), ckpt.tokenizer)
    return position_logits(engine, ids, last_only=False).log_softmax(-1)


def _kl(p: torch.Tensor, q: torch.Tensor) -> float:
    """Mean over positions of KL(p || q), both log-probabilities [N, vocab]."""
    return float((p.exp() * (p - q)).sum(-1).mean())


@needs_ops
def test_float16_pool_costs_nothing_against_the_float32_reference(embedded_checkpoint):
    """The embedded model over 400 tokens of a real agent session, teacher-forced.
    With float32 weights (`full`) the float16 pool's next-token distributions are the
    float32 pool's within KL 1e-5 (seen 5.3e-7), with the same argmax at every position.
    In the default `q4x8` (int8 activations, whose rounding turns any small change into a
    step) the float16 pool moves the distributions about as far from the float32 weights
    as the float32 pool does: within 1.25x its KL (seen 3.54e-3 against 3.50e-3)."""
    ids = _corpus_ids(embedded_checkpoint.tokenizer, 400)
    assert len(ids) == 400
    ref = _teacher_forced(embedded_checkpoint, "full", None, ids)
    full16 = _teacher_forced(embedded_checkpoint, "full", "float16", ids)
    assert _kl(ref, full16) < 1e-5
    assert torch.equal(ref.argmax(-1), full16.argmax(-1))
    q32 = _teacher_forced(embedded_checkpoint, "q4x8", None, ids)
    q16 = _teacher_forced(embedded_checkpoint, "q4x8", "float16", ids)
    assert 0 < _kl(ref, q16) < 1.25 * _kl(ref, q32)


hybrid16 = tiny_hybrid_fixture("kv16", ("qwen3_5",), kv_dtype="float16", max_num_seqs=4,
                               checkpoint_interval=32)


@needs_ops
def test_hybrid_float16_pool_logits_equal_across_chunkings_and_reuse(hybrid16):
    """A hybrid recipe (Qwen3.5: KV in its attention layers, conv and recurrent states in
    float32 beside it) keeps the same exactness with a float16 pool."""
    pkg = hybrid16.package
    assert pkg.plan.kv_dtype == "float16"

    def make(max_batch_tokens: int, max_num_seqs: int) -> Engine:
        plan = dataclasses.replace(pkg.plan, max_batch_tokens=max_batch_tokens,
                                   max_num_seqs=max_num_seqs)
        return Engine(pkg.config, plan, pkg.tensors, pkg.tokenizer,
                      namespace=pkg.manifest.package_id)

    assert make(64, 4).kv.k.dtype == torch.float16
    check_chunkings(make, PROMPT, NEW_TOKENS, chunk_sizes=(7, 64))
    check_reuse_positions(make, PROMPT, NEW_TOKENS, HYBRID_PAGE)


def _tier_engine(ckpt, kv_dtype: str | None, **kw) -> Engine:
    plan = make_plan(ckpt.config, max_seq_len=512, max_num_seqs=4, max_batch_tokens=128,
                     page_size=PAGE, kv_dtype=kv_dtype)
    return Engine(ckpt.config, plan, ckpt.tensors, ckpt.tokenizer, namespace="pkg-kv", **kw)


def _greedy_run(engine: Engine, ids: list[int], rid: str):
    from flare.runtime.request import GenerationRequest, SamplingParams
    outs = engine.run_until_idle([GenerationRequest(
        rid, ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))])[rid]
    return sum((o.token_ids for o in outs), []), outs[-1]


@needs_ops
def test_float16_states_restore_from_host_and_disk_as_recomputed(embedded_checkpoint,
                                                                 tmp_path):
    """Turn 1's float16 pages offloaded to the host tier, and to disk then read back by a
    new engine (a restart): turn 2 answers as an engine without reuse does. A float32
    package's engine over the same folder restores none of them (another layout)."""
    ck = embedded_checkpoint
    cold = _tier_engine(ck, "float16", prefix_cache=False)
    turn1 = words(41, seed=1)
    host = _tier_engine(ck, "float16", host_tier_bytes=64 << 20)
    answer, _ = _greedy_run(host, turn1, "t1")
    turn2 = turn1 + answer + words(9, seed=101)
    want = _greedy_run(cold, turn2, "c")[0]
    assert host.offload() > 0 and host.prefix_index.num_pages == 0
    got, last = _greedy_run(host, turn2, "t2")
    assert got == want and last.reuse["tier"] == "host" and last.num_cached_tokens == 48
    host.check_integrity()
    host.stop()

    disk = _tier_engine(ck, "float16", host_tier_bytes=0, state_dir=tmp_path,
                        write_through=False)
    _greedy_run(disk, turn1, "t1")
    disk.offload()
    disk.tiers.flush()
    disk.stop()
    other = _tier_engine(ck, None, host_tier_bytes=0, state_dir=tmp_path)
    assert _greedy_run(other, turn2, "f32")[1].num_cached_tokens == 0
    other.stop()
    restarted = _tier_engine(ck, "float16", host_tier_bytes=0, state_dir=tmp_path)
    got, last = _greedy_run(restarted, turn2, "t2")
    assert got == want and last.num_cached_tokens == 48 and last.reuse["tier"] == "disk"
    restarted.check_integrity()
    restarted.stop()
