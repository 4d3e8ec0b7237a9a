"""All decoder layers and the output layer in one native call (`flare.models.native_layers`,
kernels/layers.cpp): the engine's fp32 logits are bit-identical (`torch.equal`) to the
Python fused path's (`LlamaModel._forward_fused`'s per-op loop, then `LlamaModel.logits`),
step by step, for prefill chunks of 1, 7 and 64 tokens, decode at batch 1 and at batch 5
over different lengths (mixed with prefill chunks), on 1 and 2 threads (on 2, a decode
step of an int8 model runs as one team of threads, kernels/team.h).

Models: the embedded SmolLM2 (its default `q4x8`), a tiny random Llama and the tiny
random Qwen3 (per-head q/k norm) in `q4x8`, `q8x8` and `full` (dense panels), a tiny
random Qwen2 (q/k/v bias) in `q4x8`; and in `kx8`, tiny GGUFs written by test_kquant's
builder: the Q4_K_M mix (Q4_K beside Q6_K, stacked in one q/k/v projection) and a
Q5_0 / Q5_1 / Q5_K / Q8_0 mix, in chunks of 7 and at batch 5 only (to stay small). Every model's output layer runs in the native call (asserted).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from engine_helpers import words
from exactness import assert_same_logits, run_recorded
from gguf_files import tokenizer_fields_of
from test_kquant import FILES as KQUANT_FILES
from test_kquant import write_k_gguf

from flare.loading.checkpoint import load_checkpoint
from flare.models import llama
from flare.models.quant.storage import convert_tensors
from flare.package.plan import make_plan
from flare.runtime.engine import Engine

PAGE = 16
NEW_TOKENS = 4
PROMPT = words(70, seed=5)  # 4 full pages and a partial one
BATCH = {f"s{i}": words(9 + 17 * i, seed=300 + i) for i in range(5)}  # 9 .. 77 tokens


CASES = [("embedded", "q4x8"), ("tiny_llama", "q4x8"), ("tiny_llama", "q8x8"),
         ("tiny_qwen3", "q4x8"), ("tiny_qwen3", "q8x8"), ("tiny_qwen3", "full"),
         ("tiny_qwen2", "q4x8")]
# A file whose layers stack their q/k/v differently, as llama.cpp's Q4_K_M gives some
# layers' v more bits: layer 0 [q k | v], layer 1 [q | k v] (a decode team then holds two
# widths of output for each part).
KQUANT_SPECS = {**KQUANT_FILES, "q4_k_m_by_layer": (
    {"*": "Q4_K", "v_proj": "Q6_K", "1.k_proj": "Q6_K", "down_proj": "Q6_K"}, "Q4_K",
    "Q6_K", "kx8")}
KX8_CASES = [("q4_k_m", "kx8"), ("q5_mix", "kx8"),  # every kind of kx8 between them
             ("q4_k_m_by_layer", "kx8")]


def tiny_qwen2(folder, tokenizer):
    """A random 2-layer Qwen2 (q/k/v bias, untied) saved by transformers, loaded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(13)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                      max_position_embeddings=1024, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # transformers starts biases at zero: make the add visible
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_checkpoint(folder)


def engine_maker(request, name: str, fmt: str):
    """make(max_batch_tokens, max_num_seqs, native) -> an Engine of model `name` in `fmt`;
    native=False keeps the Python fused path (the reference)."""
    if name in KQUANT_SPECS:
        path = request.getfixturevalue("tmp_path_factory").mktemp("gguf") / f"{name}.gguf"
        write_k_gguf(path, KQUANT_SPECS[name],
                     tokenizer_fields_of(request.getfixturevalue("embedded_gguf")))
        ckpt = load_checkpoint(path)
    elif name == "tiny_qwen2":
        folder = request.getfixturevalue("tmp_path_factory").mktemp("tiny-qwen2") / "m"
        ckpt = tiny_qwen2(folder, request.getfixturevalue("embedded_checkpoint").tokenizer)
    else:
        ckpt = {"embedded": lambda: request.getfixturevalue("embedded_checkpoint"),
                "tiny_llama": lambda: request.getfixturevalue("tiny_llama"),
                "tiny_qwen3": lambda: load_checkpoint(
                    request.getfixturevalue("tiny_qwen3_dir"))}[name]()
    stored = convert_tensors(ckpt.tensors, fmt, getattr(ckpt, "blocks", None))

    def build(max_batch_tokens: int, max_num_seqs: int, native: bool) -> Engine:
        plan = make_plan(ckpt.config, max_seq_len=256, max_num_seqs=max_num_seqs,
                         max_batch_tokens=max_batch_tokens, page_size=PAGE)
        engine = Engine(ckpt.config, plan, stored, ckpt.tokenizer)
        native_call = engine.model.native
        assert native_call is not None, f"{name} in {fmt}: no native layers"
        assert native_call.has_lm_head, f"{name} in {fmt}: lm_head outside the native call"
        if not native:
            engine.model.native = None
        return engine

    return build


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{f}" for m, f in CASES])
def make(request):
    return engine_maker(request, *request.param)


@pytest.fixture(scope="module", params=KX8_CASES, ids=[f"{m}-{f}" for m, f in KX8_CASES])
def make_kx8(request):
    return engine_maker(request, *request.param)


@pytest.fixture
def native_calls(monkeypatch):
    """How many steps ran through the native call ("logits": those that ran the output
    layer there too), and how many fell back to the Python loop (a counter around the
    real `native_forward`)."""
    calls = {"native": 0, "logits": 0, "fallback": 0}
    real = llama.native_forward

    def counted(*args, **kwargs):
        y = real(*args, **kwargs)
        calls["native" if y is not None else "fallback"] += 1
        rows = args[6] if len(args) > 6 else kwargs.get("rows")
        calls["logits"] += y is not None and rows is not None
        return y

    monkeypatch.setattr(llama, "native_forward", counted)
    return calls


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _compare(make, prompts: dict[str, list[int]], max_batch_tokens: int,
             max_num_seqs: int, label: str) -> None:
    ref = run_recorded(make(max_batch_tokens, max_num_seqs, native=False), prompts,
                       NEW_TOKENS)
    got = run_recorded(make(max_batch_tokens, max_num_seqs, native=True), prompts,
                       NEW_TOKENS)
    for rid in prompts:
        assert_same_logits(got[rid][1], ref[rid][1], f"{label}, {rid}")
        assert got[rid][0] == ref[rid][0]


def _all_native(calls: dict[str, int]) -> None:
    assert calls["logits"] > 0 and calls["fallback"] == 0, calls


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_prefill_chunks_and_decode_at_batch_1(make, chunk, threads, native_calls):
    _compare(make, {"x": PROMPT}, chunk, 1, f"chunk {chunk}, {threads} threads")
    _all_native(native_calls)


def test_decode_at_batch_5_over_different_lengths(make, threads, native_calls):
    _compare(make, BATCH, 64, 5, f"batch 5, {threads} threads")
    _all_native(native_calls)


def test_decode_at_batch_2(make, threads, native_calls):
    """Two sequences: in a team each member quantizes its own copy of x's rows (qdot8.cpp's
    TEAM_OWN_ROWS), in the team's buffers."""
    two = {k: BATCH[k] for k in ("s0", "s3")}
    _compare(make, two, 128, 2, f"batch 2, {threads} threads")
    _all_native(native_calls)


def test_k_quant_and_q5_files(make_kx8, threads, native_calls):
    _compare(make_kx8, {"x": PROMPT}, 7, 1, f"chunk 7, {threads} threads")
    _compare(make_kx8, BATCH, 64, 5, f"batch 5, {threads} threads")
    _all_native(native_calls)


def _runs_as_team(request, maker, fixture: str) -> None:
    name, fmt = request.node.callspec.params[fixture]
    native = maker(64, 5, native=True).model.native
    assert native.decodes_as_team == (fmt != "full"), f"{name} in {fmt}"


def test_decode_steps_run_as_one_team(request, make):
    """A decode step of an int8 model runs its layers as one team of threads (team.h:
    biases included), so the 2-thread comparisons above check the team's results against
    the Python path; dense panels keep one region a kernel."""
    _runs_as_team(request, make, "make")


def test_k_quant_decode_steps_run_as_one_team(request, make_kx8):
    """The same for the K-quant mixes, whose q/k/v parts are stacked."""
    _runs_as_team(request, make_kx8, "make_kx8")


@pytest.mark.parametrize("failing", [0, 1])
def test_a_member_failing_alone_fails_the_team_without_a_hang(failing):
    """A member whose own share of a for_range throws (an allocation, a check of its
    rows) must not leave the other members waiting at the barrier: every member leaves
    the team, and the call raises the failing member's own error. Run in a child process
    with a deadline, so a team that hangs fails the test instead of the suite."""
    code = ("import sys, torch; from flare.kernels import fused_ops; m = fused_ops()\n"
            "assert m.team_failure_check(2, -1) == 128  # no member fails: both calls ran\n"
            "try:\n"
            f"    m.team_failure_check(2, {failing})\n"
            "except RuntimeError as exc:\n"
            "    print(exc)\n"
            "else:\n"
            "    sys.exit('no error')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"member {failing} failed on its share" in out.stdout
    assert "another member" not in out.stdout  # the failing member's error, not Abandoned
