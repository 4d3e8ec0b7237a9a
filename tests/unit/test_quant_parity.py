"""Greedy parity of the `fp16`, `q4` and `q4x8` weight formats against transformers on the
same weights (and, for `q4x8`, the same int8 activation rounding).

The engine runs SmolLM2's weights rounded to float16 (what a default CPU package stores)
through fbgemm's fp16 GEMM; transformers runs the same float16 values widened to float32
with its own fp32 matmuls. The two differ only in summation order, so greedy tokens must
be equal and the last-position logits close (about 5e-5 seen; the bound below is 1e-3).
Against the unrounded fp32 weights the logits move by about 2e-2 and greedy tokens
happened to stay equal on these prompts; that is a property of the model, not checked.
"""

from __future__ import annotations

import pytest
import torch
from hf_reference import greedy_logit_diffs, hf_model, round_linear_inputs_to_int8

from flare.models.quant.storage import convert_tensors
from flare.package.plan import make_plan
from flare.runtime.engine import Engine

PROMPTS = [
    "The capital of France is",
    "def reverse_string(s):",
    "Explain paged attention in one sentence:",
]
NEW_TOKENS = 32


@pytest.mark.slow
def test_smollm2_fp16_weights_greedy_tokens_equal_transformers(embedded_checkpoint):
    ckpt = embedded_checkpoint
    stored = convert_tensors(ckpt.tensors, "fp16")
    model = hf_model(ckpt.config, {k: v.float() for k, v in stored.items()})
    plan = make_plan(ckpt.config, max_seq_len=512, max_num_seqs=4)
    engine = Engine(ckpt.config, plan, stored, ckpt.tokenizer)
    prompts = [ckpt.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    diffs = greedy_logit_diffs(engine, model, prompts, NEW_TOKENS, "fp16 weights")
    assert max(diffs) < 1e-3
    engine.check_integrity()


# ---- weight format q4: transformers on the same dequantized weights ------------------------

def _dequantized(stored: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The float32 weights a `q4` or `q4x8` package stands for, Hugging Face names."""
    from flare.models.quant.storage import (
        Q4_SUFFIXES,
        Q4X8_SUFFIXES,
        Q8_SUFFIXES,
        Q8X8_SUFFIXES,
        weight_getter,
    )

    get = weight_getter(stored)
    suffixes = Q4_SUFFIXES + Q8_SUFFIXES + Q4X8_SUFFIXES + Q8X8_SUFFIXES
    names = {n.removesuffix(s) for n in stored for s in suffixes if n.endswith(s)} | {n for n in stored if not n.split(".")[-1].startswith("q")}
    out = {}
    for n in names:
        w = get(n)
        out[n] = w.dequantize() if hasattr(w, "dequantize") else w.float()
    return out


def _q4_parity(ckpt, prompts: list[str], new_tokens: int, max_logit_diff: float,
               fmt: str = "q4") -> None:
    stored = convert_tensors(ckpt.tensors, fmt)
    model = hf_model(ckpt.config, _dequantized(stored))
    if fmt == "q4x8":
        round_linear_inputs_to_int8(model)
    plan = make_plan(ckpt.config, max_seq_len=512, max_num_seqs=4)
    engine = Engine(ckpt.config, plan, stored, ckpt.tokenizer)
    ids_list = [ckpt.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    diffs = greedy_logit_diffs(engine, model, ids_list, new_tokens, f"{fmt} weights")
    assert max(diffs) < max_logit_diff
    engine.check_integrity()


@pytest.mark.parametrize("fmt", ["q4", "q4x8"])
@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama_q4_weights_greedy_tokens_equal_transformers(embedded_checkpoint, tmp_path,
                                                                 tied, fmt):
    """A random tiny Llama (SmolLM2's shape family, 2 layers), `q4` / `q4x8` weights:
    greedy tokens of the engine (q4: q4/q8 kernel at decode, dequantize + MKL for prompts
    over 16 tokens; q4x8: the int8-activation kernel throughout) equal transformers' on the
    dequantized weights (q4x8: with each linear layer's input rounded to int8 blocks)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from flare.loading.checkpoint import load_checkpoint

    torch.manual_seed(7)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                      max_position_embeddings=1024, rms_norm_eps=1e-5,
                      tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
    embedded_checkpoint.tokenizer.save_pretrained(tmp_path / "m")
    prompts = PROMPTS + ["word " * 30]  # 5 to 31 tokens: both the kernel and MKL paths
    _q4_parity(load_checkpoint(tmp_path / "m"), prompts, 16, 1e-4, fmt)


@pytest.mark.slow
def test_smollm2_q4_weights_greedy_tokens_equal_transformers(embedded_checkpoint):
    _q4_parity(embedded_checkpoint, PROMPTS, NEW_TOKENS, 1e-3)


@pytest.mark.slow
def test_smollm2_q4x8_next_tokens_agree_with_transformers(embedded_checkpoint):
    """The embedded model in `q4x8` against transformers on the same dequantized weights
    with each linear layer's input rounded to int8 blocks, teacher-forced on transformers'
    own greedy continuations (so one early disagreement does not decide the rest).

    Not token-exact: int8 rounding is a step function, so the last-bit differences of
    summation order (1e-5 in `fp16`, `q4`) move an activation that sits at a rounding
    midpoint by a whole step; SmolLM2's hidden states have outliers, so a block's step
    can be large, and 30 layers carry it on. Seen over these prompts: next-token
    agreement 92/96, KL(ref || ours) mean 2.8e-3 (max 1.3e-2), logits max abs diff
    1.66 (with SDPA attention, before Flare's fixed-order attention routine: 96/96, the
    same KL, 1.25: the argmax flips sit at near-ties). Bounds: at most 6 disagreements
    of 96, KL mean under 1e-2 and max under 0.1."""
    import torch.nn.functional as F
    from engine_helpers import position_logits

    ckpt = embedded_checkpoint
    stored = convert_tensors(ckpt.tensors, "q4x8")
    model = hf_model(ckpt.config, _dequantized(stored))
    round_linear_inputs_to_int8(model)
    engine = Engine(ckpt.config, make_plan(ckpt.config, max_seq_len=512, max_num_seqs=4),
                    stored, ckpt.tokenizer)
    agree, total, kls, diffs = 0, 0, [], []
    for prompt in PROMPTS:
        ids = ckpt.tokenizer.encode(prompt, add_special_tokens=False)
        seq = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0].tolist()
        with torch.no_grad():
            ref = model(torch.tensor([seq])).logits[0, len(ids) - 1:-1].float()
        ours = position_logits(engine, seq, last_only=False)[len(ids) - 1:-1]
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0]
        kls.append(F.kl_div(F.log_softmax(ours, -1), F.log_softmax(ref, -1), log_target=True,
                            reduction="none").sum(-1))
        diffs.append(float((ours - ref).abs().max()))
    kl = torch.cat(kls)
    print(f"q4x8: next-token agreement {agree}/{total}, KL mean {float(kl.mean()):.2e} "
          f"max {float(kl.max()):.2e}, logits max abs diff {max(diffs):.3f}")
    assert agree >= total - 6
    assert float(kl.mean()) < 1e-2 and float(kl.max()) < 0.1
    engine.check_integrity()
