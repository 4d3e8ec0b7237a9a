"""transformers as the reference for a Flare engine: its model on the same weights, its
linear layers' inputs rounded as Flare's int8-activation kernels round them, and greedy
tokens compared prompt by prompt."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from engine_helpers import greedy, last_position_logits, output_tokens

from flare.models.quant.blocks import quantize_q8
from flare.runtime.engine import Engine
from flare.runtime.request import GenerationRequest


def hf_model(config, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' float32 model for a Flare `ModelConfig` holding `tensors` (Hugging
    Face names, float); asserts that nothing is unexpected and that only a tied output
    layer is missing (then tied to the embedding)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config.to_hf()),
                                             dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)
    model.tie_weights()
    return model


def round_linear_inputs_to_int8(model: torch.nn.Module, skip: Collection[str] = ()) -> None:
    """Make every nn.Linear of `model` (but the modules named in `skip`) see its input as
    the int8-activation kernels do: each row quantized per block of 32 (`quantize_q8`)
    and dequantized again."""
    def hook(module, args):
        x = args[0]
        return (quantize_q8(x.reshape(-1, x.shape[-1])).dequantize().view(x.shape),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name not in skip:
            module.register_forward_pre_hook(hook)


def greedy_logit_diffs(engine: Engine, model: torch.nn.Module, prompts: list[list[int]],
                       new_tokens: int, label: str, near_tie: float = 0.0) -> list[float]:
    """Greedy continuations of `new_tokens` tokens by `engine` (all prompts at once) and
    by `model` (one by one), asserted equal; returns, per prompt, the max abs difference
    of the last prompt position's logits (each printed after `label`).

    With `near_tie` > 0 a continuation may part from `model`'s only at a near-tie, the
    tokens before it equal: `model`'s logits there (a full forward over the prefix) hold
    its own token and the engine's within `near_tie`, and either an int8 rounding step
    has moved that prompt's logits (their difference beyond summation order, 1e-5) or
    that forward ranks the engine's token first (`model`'s cached `generate` and its own
    full forward then disagree by summation order: seen with torch's AVX-512 kernels)."""
    outs = engine.run_until_idle([GenerationRequest(str(i), ids, greedy(new_tokens))
                                  for i, ids in enumerate(prompts)])
    diffs = []
    for i, ids in enumerate(prompts):
        ours = output_tokens(outs[str(i)])
        ref = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)[0, len(ids):].tolist()
        with torch.no_grad():
            ref_logits = model(torch.tensor([ids])).logits[0, -1].float()
        diff = float((last_position_logits(engine, ids) - ref_logits).abs().max())
        print(f"{label}: prompt of {len(ids)} tokens, logits max abs diff {diff:.3e}")
        diffs.append(diff)
        if ours != ref and near_tie > 0:
            j = next(j for j, (a, b) in enumerate(zip(ours, ref)) if a != b)
            with torch.no_grad():
                at = model(torch.tensor([ids + ref[:j]])).logits[0, -1].float()
            gap = float(at[ref[j]] - at[ours[j]])
            print(f"{label}: prompt of {len(ids)} tokens parts at step {j}, where the "
                  f"reference's margin is {gap:.2e}")
            assert abs(gap) < near_tie and (gap < 0 or diff > 1e-5), (j, gap, diff, ours, ref)
        else:
            assert ours == ref
    return diffs
