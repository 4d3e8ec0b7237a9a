"""Choose the decode attention of CUDA packages by timing it on the decode shape.

`flare prepare --device cuda` times each static decode attention serve can run
(`flare.models.attention.STATIC_ATTENTION_KINDS`: SDPA, or the float32 matmul/softmax
written out) on one layer of the plan's largest decode step: `max_num_seqs` rows
(at most `MAX_PROBE_SEQS`), each over `min(max_seq_len, MAX_PROBE_TOKENS)` tokens of a
random paged cache in the serving dtype. The fastest is recorded in the manifest's
`tuning["decode_attention"]` (with every figure) and in `graph_capture["attention"]`.

FlashInfer's paged decode is timed on the same shape when `import flashinfer` works, and
its figure recorded for comparison, but it is never chosen: serve's captured decode step
has no FlashInfer path yet.

Everything here also runs on CPU (the tests time it on tiny shapes); prepare calls it for
CUDA packages only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from flare.models.attention import STATIC_ATTENTION_KINDS, static_decode_attention

MAX_PROBE_SEQS = 64
MAX_PROBE_TOKENS = 2048


def _time_us(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    """Median microseconds of `fn` over `iters` runs after 2 warm-up runs (synchronized
    on CUDA)."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        fn()
        sync()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return sorted(times)[len(times) // 2]


def _flashinfer_us(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   num_seqs: int, tokens: int, page_size: int, iters: int) -> dict[str, Any]:
    """FlashInfer's paged decode on the probe shape: {"us": median} or {"error": why}."""
    try:
        import flashinfer  # type: ignore[import-not-found]
    except Exception as exc:  # not installed, or a broken install: say which
        return {"error": f"not available: {type(exc).__name__}: {exc}"}
    try:
        dev = q.device
        pages = -(-tokens // page_size)
        kvh, d = k_cache.shape[1], k_cache.shape[2]
        paged = torch.stack([k_cache, v_cache], 1)[: num_seqs * pages * page_size]
        paged = paged.view(num_seqs * pages, page_size, 2, kvh, d).transpose(1, 2)
        indptr = torch.arange(0, num_seqs + 1, dtype=torch.int32, device=dev) * pages
        indices = torch.arange(num_seqs * pages, dtype=torch.int32, device=dev)
        last = torch.full((num_seqs,), tokens - (pages - 1) * page_size, dtype=torch.int32,
                          device=dev)
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(indptr, indices, last, q.shape[1], kvh, d, page_size,
                     q_data_type=q.dtype, kv_data_type=k_cache.dtype)
        paged = paged.contiguous()
        return {"us": _time_us(lambda: wrapper.run(q, paged), dev, iters)}
    except Exception as exc:  # an API of another version, an unsupported shape ...
        return {"error": f"{type(exc).__name__}: {exc}"}


def measure_decode_attention(*, num_seqs: int, tokens: int, num_heads: int,
                             num_kv_heads: int, head_dim: int, page_size: int,
                             dtype: torch.dtype, device: str | torch.device,
                             iters: int = 20, seed: int = 0) -> dict[str, Any]:
    """Time each static decode attention on one layer of a decode step.

    Args:
        num_seqs: rows of the step (capped at `MAX_PROBE_SEQS`).
        tokens: context of each row (capped at `MAX_PROBE_TOKENS`; >= 1).
        num_heads, num_kv_heads, head_dim: the model's attention shape (GQA).
        page_size: tokens per KV page; each row's pages are laid out in reverse order,
            so the gather is not a plain span.
        dtype: serving dtype of queries and cache.
        device: where to run.
        iters: timed runs per kind (the median is kept).

    Returns:
        {"choice": fastest kind, "us": {kind: median microseconds}, "shape": {...},
         "flashinfer": {"us": ...} or {"error": ...}, "flashinfer_served": False}.

    Raises:
        ValueError: a value below 1, or heads not a multiple of KV heads.
    """
    if min(num_seqs, tokens, num_heads, num_kv_heads, head_dim, page_size, iters) < 1:
        raise ValueError("measure_decode_attention: every size must be >= 1")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} heads are not a multiple of {num_kv_heads} KV heads")
    dev = torch.device(device)
    b, m = min(num_seqs, MAX_PROBE_SEQS), min(tokens, MAX_PROBE_TOKENS)
    pages = -(-m // page_size)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    slots = b * pages * page_size
    k_cache = torch.randn((slots, num_kv_heads, head_dim), generator=gen).to(dev, dtype)
    v_cache = torch.randn((slots, num_kv_heads, head_dim), generator=gen).to(dev, dtype)
    q = torch.randn((b, num_heads, head_dim), generator=gen).to(dev, dtype)
    table = torch.arange(b * pages, device=dev).view(b, pages).flip(1)  # [B, P]
    gather = (table[:, :, None] * page_size
              + torch.arange(page_size, device=dev)).view(b, pages * page_size)
    lens = torch.full((b,), m, device=dev)
    mask = (torch.arange(pages * page_size, device=dev)[None, :] < lens[:, None])
    mask = mask[:, None, None, :]
    scale = head_dim ** -0.5
    us: dict[str, float] = {}
    with torch.inference_mode():
        for kind in STATIC_ATTENTION_KINDS:
            us[kind] = _time_us(lambda kind=kind: static_decode_attention(
                q, k_cache, v_cache, gather, mask, scale, kind), dev, iters)
        flashinfer = (_flashinfer_us(q, k_cache, v_cache, b, m, page_size, iters)
                      if dev.type == "cuda" else {"error": "CPU: not applicable"})
    return {"choice": min(us, key=us.__getitem__), "us": us,
            "shape": {"num_seqs": b, "tokens": m, "num_heads": num_heads,
                      "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                      "page_size": page_size, "dtype": str(dtype).removeprefix("torch.")},
            "flashinfer": flashinfer, "flashinfer_served": False}
