"""The gated delta rule of Qwen3.5's Gated DeltaNet layers (`flare.models.qwen3_5`), token
by token over a step's runs of tokens, each run from and into its sequence's recurrent
state slot: recurrent.cpp's kernel, or a torch token loop without it."""

from __future__ import annotations

from types import ModuleType

import torch

from flare.models import exact_math
from flare.models.attention import AttentionBatch


def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for each of B sequences, in torch (the step of
    `gated_delta_rule`'s fallback, and the reference of its kernel's tests).

    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q.

    Args:
        q, k: [B, H, Dk] float32, L2-normalised (q also scaled by Dk^-0.5).
        v: [B, H, Dv] float32; g (log decay, <= 0), beta: [B, H] float32.
        state: [B, H, Dk, Dv] float32, the state before the token.

    Returns:
        (o [B, H, Dv], the state after the token), float32.
    """
    state = state * exact_math.exp(g)[..., None, None]
    pred = (state * k.unsqueeze(-1)).sum(-2)  # [B, H, Dv]: what S already recalls for k
    u = (v - pred) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * u.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(-2), state


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, starts: torch.Tensor,
                     slots: torch.Tensor, ops: ModuleType | None = None) -> torch.Tensor:
    """The gated delta rule, token by token, over N sequences' runs of a step's tokens, each
    from (and advancing) its recurrent state slot: decode tokens (runs of 1) and prefill
    chunks alike, so a token's output never depends on how its sequence was chunked or
    what else ran in the step.

    With `ops` (`flare.kernels.fused_ops()`, recurrent.cpp's `gated_delta_rule`) it runs
    in C++, split over (sequence, head) pairs, each element a fixed sequence of fused
    multiply-adds. Without, the torch fallback applies `gated_delta_step` to one token of
    one sequence at a time (always the same shapes, so it too is consistent between
    decode and prefill, though not bit-equal to the kernel); it is slow for long prompts.

    Args:
        q, k: [T, Hq, Dk] float32, L2-normalised (q also scaled by Dk^-0.5); value head h
            reads query/key head h // (H / Hq).
        v: [T, H, Dv] float32; g (log decay, <= 0), beta: [T, H] float32.
        state: [S, H, Dk, Dv] float32 state pool, updated in place.
        starts: int64 [N + 1], sequence n's tokens are [starts[n], starts[n+1]).
        slots: int64 [N] distinct state slots of the sequences.
        ops: the kernel module, or None for the torch fallback.

    Returns:
        o [T, H, Dv] float32.

    Raises:
        RuntimeError: (kernel) a wrong dtype or shape, a slot out of range or named twice.
    """
    if ops is not None:
        return ops.gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(),
                                    g.contiguous(), beta.contiguous(), state, starts, slots)
    r = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for n, slot in enumerate(slots.tolist()):
        s = state[slot:slot + 1]
        for t in range(int(starts[n]), int(starts[n + 1])):
            o[t:t + 1], s = gated_delta_step(q[t:t + 1], k[t:t + 1], v[t:t + 1],
                                             g[t:t + 1], beta[t:t + 1], s)
        state[slot] = s[0]
    return o


def step_runs(batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule`'s (starts int64 [N + 1], slots int64 [N]) of a step: each decode
    token a run of one, then each prefill chunk, in the step's token order."""
    starts, slots = [0], []
    dec = batch.decode
    if dec is not None:
        starts += range(1, dec.num_seqs + 1)
        slots += dec.state_slots.tolist()
    for chunk in batch.prefills:
        starts.append(chunk.start + chunk.length)
        slots.append(chunk.state_slot)
    return torch.tensor(starts, dtype=torch.int64), torch.tensor(slots, dtype=torch.int64)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] / its L2 norm over the last axis (eps 1e-6 under the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # as fla / transformers
