"""Attention over a paged KV cache, for a batch that mixes decode tokens and prefill chunks.

Exactness: with Flare's kernel module (`ops`), every query row, decode token or prefill
row, runs one routine whose reduction order depends only on the row's own key count, so
a token's attention output never depends on chunking, reuse or batch composition.

The engine lays the step's tokens out as `[decode tokens..., prefill chunk 1..., chunk 2...]`
and describes where each group reads its keys from with `AttentionBatch`. The recipe calls
`paged_attention` once per layer after writing the step's K/V into the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's chunk of `length` new tokens at positions [ctx_len - length, ctx_len).

    Attributes:
        start: offset of the chunk's first token in the step's flat token list.
        length: tokens in the chunk.
        gather: int64 [ctx_len], cache slots of positions 0..ctx_len-1.
        mask: bool [length, ctx_len] (True = attend), or None when the chunk is the whole
            context (plain causal attention).
        state_slot: for hybrid recipes, the slot of the sequence's conv/recurrent states
            (holding the state at position ctx_len - length on entry; the recipe leaves the
            state at ctx_len in it). -1 for KV-only recipes.
    """

    start: int
    length: int
    gather: torch.Tensor
    mask: torch.Tensor | None
    state_slot: int = -1


@dataclass(frozen=True)
class DecodeGroup:
    """The step's decode tokens: one token per sequence, first in the flat token list.

    Attributes:
        num_seqs: B, the number of decode tokens.
        gather: int64 [B, M], cache slots of each sequence's positions, padded to M.
        mask: bool [B, 1, 1, M] (True = attend), or None when no row is padded.
        state_slots: int64 [B], for hybrid recipes the conv/recurrent state slot of each
            sequence (updated in place by one token); None for KV-only recipes.
        span: B == 1 only: the first cache slot when the sequence's positions 0..M-1 lie
            in consecutive slots (its pages are consecutive); attention then reads K/V as
            a view of the cache, without gathering them (same values, bit for bit).
            None otherwise.
        lengths: int64 [B], each sequence's context length (its row of `mask`'s True
            count), or None (then the fused decode attention is not used for B > 1).
    """

    num_seqs: int
    gather: torch.Tensor
    mask: torch.Tensor | None
    state_slots: torch.Tensor | None = None
    span: int | None = None
    lengths: torch.Tensor | None = None


@dataclass(frozen=True)
class AttentionBatch:
    """Where a step writes and reads K/V.

    Attributes:
        slot_mapping: int64 [T], the cache slot each of the T new tokens is written to.
        decode: the decode group (tokens [0, B)), or None.
        prefills: prefill chunks, after the decode tokens.
    """

    slot_mapping: torch.Tensor
    decode: DecodeGroup | None
    prefills: tuple[PrefillChunk, ...]


# The cache dtypes the fused attention and rope_store kernels take (with float32 q).
FUSED_CACHE_DTYPES = (torch.float32, torch.float16)

# The most query heads a KV head the fused attention kernel takes (attention.cpp's
# MAX_TILE_ROWS: a tile holds one position's query heads at least).
FUSED_ATTENTION_MAX_GROUP = 48


def fused_attention_fits(num_heads: int, num_kv_heads: int) -> bool:
    """Whether the fused attention kernels take a model with these head counts (GQA group
    H / KVH at most FUSED_ATTENTION_MAX_GROUP); where not, paged_attention runs torch's."""
    return num_kv_heads > 0 and num_heads // num_kv_heads <= FUSED_ATTENTION_MAX_GROUP


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch,
    scale: float, ops: ModuleType | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention of the step's queries over cached keys and values.

    Args:
        q: [T, H, D] queries (RoPE applied).
        k_cache, v_cache: [S, KVH, D] one layer's cache, already holding this step's K/V,
            in q's dtype or another (a float16 pool under float32 serving: the plan's
            kv_dtype); the torch path widens the rows it reads to q's dtype.
        batch: token layout and gather indices.
        scale: softmax scale (1/sqrt(D) for these recipes).
        ops: Flare's fused-op kernel module (`flare.kernels.fused_ops`), or None. When
            given, with float32 q and a float32 or float16 cache, every row runs the
            module's one fixed-order attention routine (kernels/attention.cpp), reading
            K/V rows in place: the
            decode group as `decode_attention` (one unmasked sequence in consecutive
            slots, `DecodeGroup.span`) or `decode_attention_gather` (any group with
            `lengths`), each prefill chunk as `cached_attention`. A row's output is then a
            function of its query and its keys only, bit for bit: the same in one prefill,
            in any chunking, after a reuse at any position, and beside any other rows.
            Without it (or in another dtype) decode and prefill run SDPA, whose
            summation order depends on the chunk: close, not bit-identical.

    Returns:
        [T, H, D] attention output, same dtype as `q`, possibly not contiguous. H must be
        a multiple of KVH (GQA).
    """
    dec = batch.decode
    fused = (ops is not None and q.dtype == torch.float32
             and k_cache.dtype in FUSED_CACHE_DTYPES
             and fused_attention_fits(q.shape[-2], k_cache.shape[1]))
    # a single group covers every token of the step: its output is the result, returned
    # as it comes (possibly strided), without a copy into `out`
    out = torch.empty_like(q) if len(batch.prefills) + (dec is not None) > 1 else None
    if dec is not None:
        b = dec.num_seqs
        m = dec.gather.shape[-1]
        kvh, d = k_cache.shape[1], q.shape[-1]
        if fused and dec.span is not None and dec.mask is None and b == 1:
            o = ops.decode_attention(q[0].contiguous(), k_cache, v_cache, dec.span, m,
                                     scale).unsqueeze(0)  # [1, H, D]
        elif fused and dec.lengths is not None:
            o = ops.decode_attention_gather(q[:b].contiguous(), k_cache, v_cache,
                                            dec.gather, dec.lengths, scale)  # [B, H, D]
        else:
            if dec.span is not None:  # one sequence in consecutive slots: a view, no copy
                a = dec.span
                k = k_cache[a:a + m].unsqueeze(0).transpose(1, 2)  # [1, KVH, M, D]
                v = v_cache[a:a + m].unsqueeze(0).transpose(1, 2)
            else:  # index_select copies whole rows: several times faster than indexing
                flat = dec.gather.reshape(-1)
                k = k_cache.index_select(0, flat).view(b, m, kvh, d).transpose(1, 2)
                v = v_cache.index_select(0, flat).view(b, m, kvh, d).transpose(1, 2)
            k, v = k.to(q.dtype), v.to(q.dtype)  # a float16 pool: widened (exact)
            # one query per sequence: fold each KV head's group of query heads into the
            # query axis ([B, KVH, G, D]), so GQA needs neither repeated K/V nor a GQA kernel
            qd = q[:b].reshape(b, kvh, -1, d)  # [B, KVH, G, D]
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=dec.mask, scale=scale)
            o = o.reshape(b, -1, d)
        if out is None:
            return o
        out[:b] = o
    for chunk in batch.prefills:
        s, t = chunk.start, chunk.length
        if fused:  # the decode rows' routine, row by row over the same key order
            ctx = chunk.gather.shape[0]
            o = ops.cached_attention(q[s:s + t].contiguous(), k_cache, v_cache,
                                     chunk.gather.reshape(1, ctx).contiguous(),
                                     torch.tensor([ctx]), t, scale)  # [t, H, D]
            if out is None:
                return o
            out[s:s + t] = o
            continue
        k = k_cache.index_select(0, chunk.gather).transpose(0, 1).unsqueeze(0)  # [1,KVH,ctx,D]
        v = v_cache.index_select(0, chunk.gather).transpose(0, 1).unsqueeze(0)
        k, v = k.to(q.dtype), v.to(q.dtype)
        qp = q[s:s + t].transpose(0, 1).unsqueeze(0)  # [1, H, t, D]
        o = F.scaled_dot_product_attention(
            qp, k, v, attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale,
            enable_gqa=True)
        if out is None:
            return o[0].transpose(0, 1)
        out[s:s + t] = o[0].transpose(0, 1)
    return out


STATIC_ATTENTION_KINDS = ("sdpa", "math")


def static_decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, gather: torch.Tensor,
    mask: torch.Tensor, scale: float, kind: str = "sdpa",
) -> torch.Tensor:
    """Decode attention over fixed shapes: one query per row, every row reading M slots.

    No data-dependent shape, no host sync and no branching on tensor values, so it can be
    captured in a CUDA graph (`flare.runtime.cuda_graphs`). Rows shorter than M read
    slots they must not see (pages past their end); `mask` hides them, so those slots only
    need finite values (the cache is zeroed at allocation and only ever holds K/V).

    Args:
        q: [B, H, D] queries (RoPE applied), serving dtype.
        k_cache, v_cache: [S, KVH, D] one layer's cache, already holding this step's K/V.
        gather: int64 [B, M], the cache slot of each row's positions 0..M-1.
        mask: bool [B, 1, 1, M], True = attend; every row attends to at least one slot.
        scale: softmax scale.
        kind: "sdpa" (`F.scaled_dot_product_attention`, as the eager decode path) or
            "math" (softmax(q K^T * scale) V written out in float32).

    Returns:
        [B, H, D] in q's dtype. H must be a multiple of KVH (GQA).

    Raises:
        ValueError: an unknown `kind`.
    """
    b, m = gather.shape
    kvh, d = k_cache.shape[1], q.shape[-1]
    flat = gather.reshape(-1)
    k = k_cache.index_select(0, flat).view(b, m, kvh, d).transpose(1, 2)  # [B, KVH, M, D]
    v = v_cache.index_select(0, flat).view(b, m, kvh, d).transpose(1, 2)
    k, v = k.to(q.dtype), v.to(q.dtype)  # a pool in another dtype (kv_dtype): widened
    qd = q.reshape(b, kvh, -1, d)  # [B, KVH, G, D]: GQA folded into the query axis
    if kind == "sdpa":
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
    elif kind == "math":
        scores = torch.matmul(qd.float(), k.float().transpose(-1, -2)) * scale  # [B,KVH,G,M]
        scores = scores.masked_fill(~mask, float("-inf"))
        o = torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)
    else:
        raise ValueError(f"static decode attention {kind!r} unknown; "
                         f"known: {list(STATIC_ATTENTION_KINDS)}")
    return o.reshape(b, -1, d)
