"""All decoder layers of a dense step, and the output layer on the rows that sample, in
one native call (`DenseLayers`, kernels/layers.cpp).

`LlamaModel._forward_fused` calls one kernel per op from Python, about nine a layer; at
batch 1 the Python between them (wrappers, views, argument packing) is a large share of
a step. `native_layers(model)` describes the model's weights once, at load, to the C++
`DenseLayers`, whose `forward` runs the same kernels in the same order, and whose
`forward_logits` adds the lm_head on the chosen rows: the results are bit-identical to
the Python fused path and `LlamaModel.logits`.

Covered: every linear in a kernel of Flare's own (weight formats `q4x8`, `q8x8`, `kx8`
(Q4_K, Q5_K, Q6_K, Q5_0 / Q5_1, Q8_0, and `StackedWeight`s of them), and the dense
panels of `fp16` and `full`), with or without a bias (Qwen2) and per-head q/k norm
(Qwen3). Not covered, so the Python fused path runs: format `q4` (plain Q4Weight /
Q8Weight: their kernel depends on the row count), fbgemm's fp16 or F.linear fallbacks,
and a step whose decode group has neither a single span nor lengths (the SDPA fallback
of `paged_attention`). An lm_head outside these kinds runs in Python after the layers.
$FLARE_NATIVE_LAYERS=0 turns the native call off (the Python fused path then runs).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from flare.kernels import weight_prefetch
from flare.models.attention import AttentionBatch, fused_attention_fits
from flare.models.quant.interleaved import Q4x8Weight, Q8x8Weight
from flare.models.quant.kquants import Q4Kx8Weight, Q6Kx8Weight
from flare.models.quant.linear import Linear
from flare.models.quant.q5 import Q5Kx8Weight, Q5x8Weight
from flare.state.pools import KVCache

LinearSpec = tuple[str, list[torch.Tensor], int, torch.Tensor | None, list]


def linear_spec(lin: Linear) -> LinearSpec | None:
    """`lin` as layers.cpp's linear tuple (kind, tensors, out_features, bias, parts), or
    None when its kernel is not one the native call runs."""
    bias = lin.bias
    if lin.panels is not None:
        kind = "f16" if lin.panels.dtype == torch.float16 else "f32"
        return kind, [lin.panels], lin.out_features, bias, []
    if lin.stacked is not None:
        parts = [linear_spec(p) for p in lin.stacked]
        if any(p is None for p in parts):
            return None
        return "stacked", [], lin.out_features, bias, parts
    w = lin.qweight
    if isinstance(w, Q4x8Weight):
        return "q4x8", [w.codes, w.scales, w.mins], lin.out_features, bias, []
    if isinstance(w, Q8x8Weight):
        return "q8x8", [w.codes, w.scales], lin.out_features, bias, []
    if isinstance(w, Q4Kx8Weight):
        return "q4kx8", [w.codes, w.scales, w.mins, w.d, w.dmin], lin.out_features, bias, []
    if isinstance(w, Q6Kx8Weight):
        return "q6kx8", [w.codes, w.scales, w.d], lin.out_features, bias, []
    if isinstance(w, Q5x8Weight):
        return "q5x8", [w.codes, w.high, w.scales, w.mins], lin.out_features, bias, []
    if isinstance(w, Q5Kx8Weight):
        return ("q5kx8", [w.codes, w.high, w.scales, w.mins, w.d, w.dmin], lin.out_features,
                bias, [])
    return None


def native_layers(model: Any) -> Any | None:
    """A `DenseLayers` over the layers of `model` (a `flare.models.llama.LlamaModel`; not
    imported here: llama imports this module), or None where the native call cannot serve:
    no fused ops (`model.fused_ops` is None), more query heads a KV head than the fused
    attention takes (`fused_attention_fits`), a layer's linear of an uncovered kind (see
    the module docstring), or $FLARE_NATIVE_LAYERS=0. Its `has_lm_head` says whether it
    also holds `model.lm_head` (a covered kind) for `native_forward(..., rows=)`.
    Building one sets the kernels' weight prefetch hint for the bytes its linears hold
    (`flare.kernels.weight_prefetch`)."""
    ops = model.fused_ops
    if (ops is None or not model.layers or not hasattr(ops, "DenseLayers")
            or not fused_attention_fits(model.num_heads, model.num_kv_heads)
            or os.environ.get("FLARE_NATIVE_LAYERS", "1").strip() == "0"):
        return None
    layers = []
    lm_head = linear_spec(model.lm_head)
    weight_bytes = spec_bytes(lm_head)
    for layer in model.layers:
        specs = [linear_spec(lin) for lin in (layer.qkv, layer.o_proj, layer.gate_up,
                                              layer.down)]
        if any(s is None for s in specs):
            return None
        qkv, o_proj, gate_up, down = specs
        layers.append((layer.input_norm, qkv, layer.qk_norm, o_proj, layer.post_norm,
                       gate_up, down))
        weight_bytes += sum(map(spec_bytes, specs))
    weight_prefetch.apply(ops, weight_bytes)
    return ops.DenseLayers(layers, model.final_norm, model.cos, model.sin_signed,
                           model.num_heads, model.num_kv_heads, model.eps, model.scale,
                           lm_head)


def spec_bytes(spec: LinearSpec | None) -> int:
    """The bytes a step reads of the linear `spec` describes (its tensors, its bias and its
    parts'), 0 for None."""
    if spec is None:
        return 0
    _, tensors, _, bias, parts = spec
    return (sum(t.nbytes for t in tensors) + (0 if bias is None else bias.nbytes)
            + sum(map(spec_bytes, parts)))


def native_embedding(embed: Any, ops: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The token lookup of `embed` (the model's embedding table) in one native call of
    `ops` (the fused-op kernel module, rows.cpp): a function of ids (int64 [T]) returning
    float32 [T, K], the same bits as `embed[ids]`; None where `ops` is None or lacks the
    call, or `embed` is not a `Q8x8Weight` / `Q4x8Weight` (then `embed[ids]` serves).
    The ids must lie in [0, N) (the call raises RuntimeError otherwise)."""
    if ops is None or not hasattr(ops, "q8x8_rows"):
        return None
    if isinstance(embed, Q8x8Weight):
        codes, scales = embed.codes, embed.scales
        return lambda ids: ops.q8x8_rows(codes, scales, ids)
    if isinstance(embed, Q4x8Weight):
        codes, scales, mins = embed.codes, embed.scales, embed.mins
        return lambda ids: ops.q4x8_rows(codes, scales, mins, ids)
    return None


def native_forward(native: Any, x: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, batch: AttentionBatch, kv: KVCache,
                   rows: list[int] | None = None) -> torch.Tensor | None:
    """All layers of a step through `native` (a `DenseLayers`): the final norm's output
    [T, hidden], or with `rows` the fp32 logits [len(rows), vocab] of those rows; None
    when the step's decode group needs the SDPA fallback (then the caller runs the
    Python fused path; `x` is untouched).

    Args:
        x: float32 [T, hidden], the embedded tokens, a fresh contiguous tensor (updated
            in place: the residual stream).
        positions, slots: int64 [T], contiguous.
        batch, kv: as `LlamaModel.forward`.
        rows: None for the hidden states; else indices into the T tokens (at least one),
            for a `native` whose `has_lm_head` is true.
    """
    dec = batch.decode
    kind, num_rows, span, length, gather, lengths = 0, 0, 0, 0, None, None
    if dec is not None:
        num_rows, length = dec.num_seqs, dec.gather.shape[-1]
        if dec.span is not None and dec.mask is None and num_rows == 1:
            kind, span = 1, dec.span
        elif dec.lengths is not None:
            kind, gather, lengths = 2, dec.gather, dec.lengths
        else:
            return None
    chunks = batch.prefills
    args = (x, positions, slots, kv.k, kv.v, kind, num_rows, span, length, gather, lengths,
            [c.start for c in chunks], [c.length for c in chunks],
            [c.gather.reshape(1, -1).contiguous() for c in chunks])
    if rows is None:
        return native.forward(*args)
    return native.forward_logits(*args, rows)
