"""One forward over a step's scheduled chunks: the static decode path (fixed-shape
buckets, CUDA graphs where captured) or the eager path (an `AttentionBatch` of decode
groups and prefill chunks). Mixed into `flare.runtime.engine.Engine`."""

from __future__ import annotations

from types import ModuleType

import torch

from flare.models.attention import AttentionBatch, DecodeGroup, PrefillChunk
from flare.runtime.scheduler import ScheduledChunk
from flare.runtime.sequence import Sequence


class ForwardRunner:
    """Part of `Engine` (see the module docstring)."""

    def _run_static(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """One token of each chunk through `self.decoder`: fp32 logits [n, vocab] for all
        n chunks, or, when no bucket fits, the eager path's (counted as a fallback)."""
        ps = self.plan.page_size
        ids, positions, slots, pages, lengths = [], [], [], [], []
        for c in chunks:
            seq, start = c.seq, c.seq.num_computed
            ids.append(seq.token_ids[start])
            positions.append(start)
            slots.append(seq.pages[start // ps] * ps + start % ps)
            pages.append(seq.pages)
            lengths.append(start + 1)
        logits = self.decoder.run(ids, positions, slots, pages, lengths)
        if logits is not None:
            return logits
        self.counters.eager_steps_total += 1
        rows = self._run_eager(chunks)  # the sampling chunks' rows only
        if rows is None or len(rows) == len(chunks):
            return rows
        full = rows.new_zeros((len(chunks), rows.shape[-1]))  # back to one row per chunk
        full[torch.tensor([i for i, c in enumerate(chunks) if c.samples],
                          device=rows.device)] = rows
        return full

    def _run_eager(self, chunks: list[ScheduledChunk]) -> torch.Tensor | None:
        """Forward the chunks with dynamic shapes; fp32 logits [N, vocab] of the N chunks
        that sample (in chunk order), None when none does."""
        # Step metadata is built as Python ints and turned into a few tensors at the end:
        # a decode token costs list appends, not tensor operations.
        ps = self.plan.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []  # cache slot of each decode token
        prefill_slots: list[torch.Tensor] = []  # then each prefill chunk's slots
        decode_seqs: list[Sequence] = []
        prefills, last_rows = [], []
        offset = 0
        in_decode_run = True  # decode tokens lead the flat token list (see AttentionBatch)
        for c in chunks:
            seq, start = c.seq, c.seq.num_computed
            end = start + c.num_tokens
            ids.extend(seq.token_ids[start:end])
            in_decode_run = in_decode_run and c.num_tokens == 1
            if in_decode_run:
                positions.append(start)
                slots.append(seq.pages[start // ps] * ps + start % ps)
                decode_seqs.append(seq)
            else:
                positions.extend(range(start, end))
                gather = self.kv.slots(seq.pages, 0, end)
                prefill_slots.append(gather[start:])
                mask = None
                if start > 0:  # chunk after cached context: causal with an offset
                    mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
                prefills.append(PrefillChunk(offset, c.num_tokens, gather, mask,
                                             seq.state_slot))
            offset += c.num_tokens
            if c.samples:
                last_rows.append(offset - 1)
        decode = None
        if decode_seqs:
            decode = _decode_group(
                [s.pages for s in decode_seqs], [s.num_computed + 1 for s in decode_seqs], ps,
                [s.state_slot for s in decode_seqs] if self.states is not None else None,
                getattr(self.model, "fused_ops", None))
        slot_mapping = torch.tensor(slots, dtype=torch.int64)
        if prefill_slots:
            slot_mapping = torch.cat([slot_mapping, *prefill_slots])
        batch = AttentionBatch(slot_mapping, decode, tuple(prefills))
        input_ids = torch.tensor(ids, dtype=torch.int64)
        pos = torch.tensor(positions, dtype=torch.int64)
        if self.device.type != "cpu":  # built on the host: one copy each to the device
            batch = _batch_to(batch, self.device)
            input_ids, pos = input_ids.to(self.device), pos.to(self.device)
        if self.states is None:  # dense: the output layer in the model's own step call
            return self.model.forward_logits(input_ids, pos, batch, self.kv, last_rows)
        hidden = self.model.forward(input_ids, pos, batch, self.kv, self.states)
        if not last_rows:
            return None
        return self.model.logits(hidden[torch.tensor(last_rows, device=hidden.device)])


def _decode_group(pages: list[list[int]], lengths: list[int], page_size: int,
                  state_slots: list[int] | None = None,
                  ops: ModuleType | None = None) -> DecodeGroup:
    """The decode group of B sequences, in a handful of tensor operations whatever B.

    Args:
        pages: each sequence's page table.
        lengths: each sequence's context length in tokens, its new token included.
        page_size: tokens per page.
        state_slots: hybrid recipes: each sequence's state slot; None for KV-only.
        ops: Flare's kernel module, or None: with it the gather is built in one call
            (`page_gather`, the same values).

    Returns:
        A `DecodeGroup` whose gather is int64 [B, M] (contiguous), M = max(lengths): the
        cache slots of positions 0..M-1; rows of shorter sequences point at slots of page 0
        past their length, and `mask` ([B, 1, 1, M], True = attend) hides them (None when
        every length is M); `lengths` is int64 [B]. For one sequence on consecutive
        pages, `span` is its first slot (attention reads K/V without a gather).
    """
    b, m = len(lengths), max(lengths)
    n = -(-m // page_size)  # pages of the longest sequence
    span = None
    if b == 1 and pages[0][n - 1] - pages[0][0] == n - 1 and (
            pages[0][:n] == list(range(pages[0][0], pages[0][0] + n))):
        span = pages[0][0] * page_size
    if ops is not None and hasattr(ops, "page_gather"):  # one native call (rows.cpp)
        gather, lens = ops.page_gather(pages, lengths, page_size)
    else:
        table = torch.tensor([p[:n] + [0] * (n - len(p[:n])) for p in pages],
                             dtype=torch.int64)
        offsets = torch.arange(page_size, dtype=torch.int64)
        gather = (table[:, :, None] * page_size + offsets).view(b, n * page_size)[:, :m]
        lens = torch.tensor(lengths, dtype=torch.int64)
    mask = None
    if min(lengths) != m:
        mask = (torch.arange(m)[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, M]
    slots = torch.tensor(state_slots, dtype=torch.int64) if state_slots is not None else None
    return DecodeGroup(b, gather.contiguous(), mask, slots, span, lens)


def _batch_to(batch: AttentionBatch, device: torch.device) -> AttentionBatch:
    """`batch` with every tensor copied to `device` (the eager path builds it on the host)."""
    def to(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    dec = batch.decode
    if dec is not None:
        dec = DecodeGroup(dec.num_seqs, to(dec.gather), to(dec.mask), to(dec.state_slots),
                          dec.span, to(dec.lengths))
    chunks = tuple(PrefillChunk(c.start, c.length, to(c.gather), to(c.mask), c.state_slot)
                   for c in batch.prefills)
    return AttentionBatch(to(batch.slot_mapping), dec, chunks)
