"""Hybrid recipes (Qwen3.5, LFM2) in the engine, end to end: a tiny random checkpoint saved
by transformers is prepared into a package, loaded with `load_package` and served by
`Engine.from_package`. Greedy tokens equal transformers' `generate`; batched, chunked and
preempted runs give each request's solo answer; pages and state slots return to baseline;
the package records the state layout and serve refuses one whose layout differs.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from flare.package.contract import MANIFEST_NAME, PackageError
from flare.models.recipe import recipe_for
from flare.package.reader import load_package
from flare.package.plan import layout_for
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, SamplingParams
from hybrid_models import RECIPES, build_tiny_hybrid, hf_greedy

NEW = 16
TEXTS = ["The capital of France is",
         "def reverse_string(s):\n    return",
         "Long conversations with coding agents repeat the same system prompt, the same tool "
         "definitions and most of the history on every turn, so a server that keeps the "
         "state of a conversation can skip recomputing the prefix."]


def greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=RECIPES)
def tiny(request, tmp_path_factory, embedded_checkpoint):
    root = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    h = build_tiny_hybrid(request.param, root, embedded_checkpoint.tokenizer)
    tok = h.package.tokenizer
    h.extra["prompts"] = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    h.extra["expected"] = [hf_greedy(h.hf_model, p, NEW) for p in h.extra["prompts"]]
    return h


def make_engine(tiny, prefix_cache: bool = True, **plan_changes) -> Engine:
    pkg = tiny.package
    plan = pkg.plan
    if "max_num_seqs" in plan_changes:
        plan_changes.setdefault("state_slots", plan_changes["max_num_seqs"])
    plan = dataclasses.replace(plan, **plan_changes)
    return Engine(pkg.config, plan, pkg.tensors, pkg.tokenizer,
                  namespace=pkg.manifest.package_id, prefix_cache=prefix_cache)


def tokens(outs) -> list[int]:
    return sum((o.token_ids for o in outs), [])


def run_all(engine: Engine, prompts, params=None) -> list[list[int]]:
    outs = engine.run_until_idle([GenerationRequest(str(i), p, params or greedy())
                                  for i, p in enumerate(prompts)])
    return [tokens(outs[str(i)]) for i in range(len(prompts))]


def assert_baseline(engine: Engine) -> None:
    """Idle engine: only the prefix index holds pages and only checkpoints hold state
    slots; clearing both empties the pools."""
    engine.check_integrity()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.pool.num_used == (engine.prefix_index.num_pages if engine.prefix_index else 0)
    assert engine.states is not None
    assert engine.states.num_used == (len(engine.checkpoints) if engine.checkpoints else 0)
    if engine.checkpoints is not None:
        engine.checkpoints.clear()
    if engine.prefix_index is not None:
        engine.prefix_index.clear()
    engine.check_integrity()
    assert engine.pool.num_used == 0 and engine.states.num_used == 0


def test_package_records_recipe_layout_and_state_pool(tiny):
    m = tiny.package.manifest
    cfg, plan = tiny.package.config, tiny.package.plan
    assert m.recipe == tiny.recipe == recipe_for(cfg)
    assert m.config == json.loads((tiny.folder / "config.json").read_text())
    layout = layout_for(cfg, plan)
    assert layout.is_hybrid and m.state_layout == layout.describe()
    assert m.state_layout["kv_layers"] == [1, 4]
    assert [s["layer"] for s in m.state_layout["layer_states"]] == [0, 2, 3]
    assert plan.state_slots == plan.max_num_seqs == 4
    assert plan.checkpoint_slots == 2 * plan.max_num_seqs
    slots = plan.state_slots + plan.checkpoint_slots
    assert m.memory["state_slots"] == slots
    assert m.memory["state_bytes_per_slot"] == layout.state_bytes_per_slot > 0
    assert m.memory["state_pool_bytes"] == slots * layout.state_bytes_per_slot
    assert m.memory["total_bytes"] == (m.memory["weights_bytes"] + m.memory["kv_pool_bytes"]
                                       + m.memory["state_pool_bytes"]
                                       + m.memory["workspace_bytes"]
                                       + m.memory["host_tier_bytes"]  # CPU: host = device
                                       + m.memory["runtime_bytes"])
    engine = Engine.from_package(tiny.package)
    assert engine.states.num_slots == slots
    assert engine.states.nbytes == m.memory["state_pool_bytes"]
    assert engine.kv.nbytes == m.memory["kv_pool_bytes"]


def test_greedy_tokens_equal_transformers_generate(tiny):
    engine = Engine.from_package(tiny.package)
    for prompt, expected in zip(tiny.extra["prompts"], tiny.extra["expected"]):
        assert run_all(engine, [prompt])[0] == expected
    assert_baseline(engine)


def test_batched_answers_equal_solo_answers(tiny):
    engine = make_engine(tiny, prefix_cache=False)
    assert run_all(engine, tiny.extra["prompts"]) == tiny.extra["expected"]
    assert_baseline(engine)


def test_chunked_prefill_equals_whole_prefill(tiny):
    """max_batch_tokens 7: every prefill is cut into chunks that end inside pages, and the
    three prompts share steps with each other's decodes."""
    for prefix_cache in (False, True):
        engine = make_engine(tiny, prefix_cache=prefix_cache, max_batch_tokens=7)
        assert run_all(engine, tiny.extra["prompts"]) == tiny.extra["expected"]
        assert_baseline(engine)


def test_preemption_under_a_tiny_pool_gives_the_same_answers(tiny):
    ps = tiny.extra["prompts"]
    params = greedy(60)
    roomy = make_engine(tiny, prefix_cache=False)
    alone = [run_all(roomy, [p], params)[0] for p in ps]
    for prefix_cache in (False, True):
        # 7 pages of 16 tokens: the three sequences cannot all grow to ~100 tokens at once
        tight = make_engine(tiny, prefix_cache=prefix_cache, max_seq_len=112, num_pages=7)
        assert run_all(tight, ps, params) == alone
        assert tight.scheduler.num_preemptions > 0
        assert_baseline(tight)


def test_abort_and_failed_step_release_pages_and_slots(tiny, monkeypatch):
    engine = make_engine(tiny)
    a, b, c = tiny.extra["prompts"]
    engine.add_request(GenerationRequest("a", a, greedy()))
    engine.add_request(GenerationRequest("b", b, greedy()))
    for _ in range(3):
        engine.step()
    assert engine.states.num_used >= 2
    engine.abort("a")
    engine.step()
    engine.check_integrity()
    got: list = []
    engine.on_output = got.append

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(engine.model, "forward", broken)
    engine.add_request(GenerationRequest("c", c, greedy()))
    engine.step()  # fails: b and c are aborted with the error
    assert {o.request_id for o in got if o.finished and o.error} == {"b", "c"}
    assert_baseline(engine)


def test_a_package_whose_state_layout_differs_is_refused(tiny, tmp_path):
    pkg = tmp_path / "pkg"
    shutil.copytree(tiny.package_path, pkg)
    m = json.loads((pkg / MANIFEST_NAME).read_text())
    m["state_layout"]["layer_states"][0]["conv_shape"][1] += 1
    (pkg / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(PackageError, match="state layout mismatch.*layer_states"):
        load_package(pkg)
    m["state_layout"]["layer_states"] = []  # a package that claims to be KV-only
    (pkg / MANIFEST_NAME).write_text(json.dumps(m))
    with pytest.raises(PackageError, match="state layout mismatch"):
        load_package(pkg)


def test_bfloat16_package_runs(tiny, tmp_path):
    """The serving dtype reaches KV pages and conv states (recurrent states stay fp32)."""
    from flare.prepare.package import prepare_package

    out = tmp_path / "bf16"
    prepare_package(tiny.folder, out, max_seq_len=128, max_num_seqs=2, dtype="bfloat16",
                    progress=False)
    engine = Engine.from_package(load_package(out))
    assert engine.kv.k.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 for t in engine.states.conv.values())
    assert all(t.dtype == torch.float32 for t in engine.states.recurrent.values())
    got = run_all(engine, tiny.extra["prompts"][:2], greedy(8))
    assert all(len(g) == 8 for g in got)
    assert_baseline(engine)
