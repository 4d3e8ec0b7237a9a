"""Greedy parity of recipe `llama` against transformers on the same weights.

SmolLM2 (GGUF, dequantized by our loader) against transformers' LlamaForCausalLM holding
the same tensors; a tiny random Qwen3 saved as safetensors, loaded by our loader on one
side and by transformers' own `from_pretrained` on the other.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from flare.loading.checkpoint import load_checkpoint
from flare.package.plan import make_plan
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from engine_helpers import last_position_logits  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def reverse_string(s):",
    "Explain paged attention in one sentence:",
]
NEW_TOKENS = 32


def _engine(ckpt, **plan_kw) -> Engine:
    plan = make_plan(ckpt.config, **{"max_seq_len": 512, "max_num_seqs": 4, **plan_kw})
    return Engine(ckpt.config, plan, ckpt.tensors, ckpt.tokenizer)


def _greedy(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    reqs = [GenerationRequest(str(i), ids, params) for i, ids in enumerate(prompts)]
    outs = engine.run_until_idle(reqs)
    return [sum((o.token_ids for o in outs[str(i)]), []) for i in range(len(prompts))]


def _hf_greedy(model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(ids):].tolist()


def _prefill_logits_diff(engine: Engine, model, ids: list[int]) -> float:
    """Max |ours - transformers| over the last-position logits of a prompt."""
    kv_free = engine.pool.num_free
    ours = last_position_logits(engine, ids)
    assert engine.pool.num_free == kv_free
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].float()
    return float((ours - ref).abs().max())


def _check(engine, model, tokenizer, label: str) -> None:
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    ours = _greedy(engine, prompts)
    for ids, got in zip(prompts, ours):
        diff = _prefill_logits_diff(engine, model, ids)
        print(f"{label}: prompt of {len(ids)} tokens, logits max abs diff {diff:.3e}")
        assert got == _hf_greedy(model, ids)
    engine.check_integrity()
    assert engine.pool.num_used == engine.prefix_index.num_pages


@pytest.mark.slow
def test_smollm2_gguf_greedy_tokens_equal_transformers(embedded_checkpoint):
    ckpt = embedded_checkpoint
    cfg = AutoConfig.for_model(**ckpt.config.to_hf())
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(ckpt.tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.tie_weights()
    _check(_engine(ckpt), model, ckpt.tokenizer, "smollm2")


def test_tiny_qwen3_safetensors_greedy_tokens_equal_transformers(tiny_qwen3_dir):
    ckpt = load_checkpoint(tiny_qwen3_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    assert ckpt.config.qk_norm and not ckpt.config.tie_word_embeddings
    _check(_engine(ckpt), model, ckpt.tokenizer, "tiny-qwen3")


def test_tiny_qwen2_with_attention_bias_equals_transformers(tmp_path, embedded_checkpoint):
    from transformers import Qwen2Config

    torch.manual_seed(7)
    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                      max_position_embeddings=1024, tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random biases, so a dropped bias would show
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(tmp_path)
    embedded_checkpoint.tokenizer.save_pretrained(tmp_path)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config.attention_bias
    _check(_engine(ckpt), model, ckpt.tokenizer, "tiny-qwen2")
