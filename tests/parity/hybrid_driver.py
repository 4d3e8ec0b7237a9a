"""A minimal greedy driver for the hybrid recipes, for parity tests: it builds each step's
`AttentionBatch` by hand (decode tokens first, then prefill chunks), owns a page pool, a
KV cache and a state-slot pool, and does what the engine must do for hybrid sequences:
one state slot per sequence, a chunk continues from its slot, a fork copies the slot and
shares the KV pages (copying the partly filled tail page).

It also holds what every hybrid parity test module shares: `build_tiny` and `tiny_fixture`
(the fixture's model, built by `tests/unit/hybrid_models.py`) and `HybridParityChecks`
(the tests)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from flare.models.attention import AttentionBatch, DecodeGroup, PrefillChunk
from flare.state.layout import StateLayout
from flare.state.pools import KVCache, PagePool
from flare.state.slots import StateSlotPool

# the builders live with the engine tests' (one config per recipe for every suite)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from hybrid_models import BUILDERS, hf_greedy  # noqa: E402


@dataclass
class Seq:
    tokens: list[int]  # prompt + generated; tokens[computed:] are not in the cache yet
    slot: int
    pages: list[int] = field(default_factory=list)
    computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)  # one row per sampled token

    @property
    def generated(self) -> int:
        return len(self.logits)


class Runner:
    def __init__(self, model, layout: StateLayout, num_pages: int = 96, num_slots: int = 8):
        self.model = model
        self.page_size = layout.page_size
        self.kv = KVCache(layout, num_pages, "cpu")
        self.pool = PagePool(num_pages)
        self.states = StateSlotPool(layout, num_slots)

    def new_seq(self, prompt: list[int]) -> Seq:
        return Seq(list(prompt), self.states.allocate())

    def free(self, seq: Seq) -> None:
        self.pool.release(seq.pages)
        self.states.release(seq.slot)
        seq.pages, seq.slot = [], -1

    def fork(self, seq: Seq) -> Seq:
        """A branch at `seq.computed`: its own copy of the state slot; full pages shared,
        the partly filled tail page copied (both sequences will write into it)."""
        child = Seq(list(seq.tokens), self.states.allocate(), computed=seq.computed)
        self.states.copy(seq.slot, child.slot)
        full, tail = divmod(seq.computed, self.page_size)
        self.pool.incref(seq.pages[:full])
        child.pages = seq.pages[:full]
        if tail:
            (page,) = self.pool.allocate(1)
            src = self.kv.slots(seq.pages, full * self.page_size, seq.computed)
            dst = self.kv.slots([page], 0, tail)
            self.kv.k[:, dst] = self.kv.k[:, src]
            self.kv.v[:, dst] = self.kv.v[:, src]
            child.pages.append(page)
        return child

    def _grow(self, seq: Seq, end: int) -> None:
        need = -(-end // self.page_size) - len(seq.pages)
        if need > 0:
            seq.pages += self.pool.allocate(need)

    def step(self, decode: list[Seq], chunks: list[tuple[Seq, int]]) -> torch.Tensor:
        """One forward: one token of each `decode` sequence, then `n` tokens of each chunk.
        Returns fp32 logits [len(decode) + len(chunks), V] of each group's last token."""
        ids, pos, slot_map, gathers, prefills, last = [], [], [], [], [], []
        offset = 0
        for seq, n in [(s, 1) for s in decode] + list(chunks):
            start, end = seq.computed, seq.computed + n
            self._grow(seq, end)
            ids += seq.tokens[start:end]
            pos.append(torch.arange(start, end))
            slot_map.append(self.kv.slots(seq.pages, start, end))
            gather = self.kv.slots(seq.pages, 0, end)
            if len(gathers) < len(decode):
                gathers.append(gather)
            else:
                mask = None
                if start > 0:
                    mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
                prefills.append(PrefillChunk(offset, n, gather, mask, seq.slot))
            offset += n
            last.append(offset - 1)
            seq.computed = end
        group = None
        if decode:
            m = max(g.numel() for g in gathers)
            gather = torch.zeros(len(gathers), m, dtype=torch.int64)
            for row, g in enumerate(gathers):
                gather[row, :g.numel()] = g
            lens = torch.tensor([g.numel() for g in gathers])
            mask = (torch.arange(m)[None, :] < lens[:, None])[:, None, None, :]
            group = DecodeGroup(len(decode), gather, mask,
                                torch.tensor([s.slot for s in decode], dtype=torch.int64))
        batch = AttentionBatch(torch.cat(slot_map), group, tuple(prefills))
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.int64), torch.cat(pos), batch,
                                    self.kv, self.states)
        return self.model.logits(hidden[torch.tensor(last)])

    def prefill(self, seq: Seq, chunk: int | None = None) -> torch.Tensor:
        """Compute all not-yet-computed tokens, `chunk` at a time; sample greedily after
        the last one. Returns the last token's logits [V]."""
        while len(seq.tokens) - seq.computed > 0:
            n = min(chunk or len(seq.tokens), len(seq.tokens) - seq.computed)
            logits = self.step([], [(seq, n)])[0]
        self._sample(seq, logits)
        return logits

    def decode(self, seqs: list[Seq], steps: int) -> None:
        """`steps` greedy decode steps of `seqs` together (one batch per step)."""
        for _ in range(steps):
            for seq, row in zip(seqs, self.step(seqs, [])):
                self._sample(seq, row)

    def generate(self, prompt: list[int], new_tokens: int, chunk: int | None = None) -> Seq:
        seq = self.new_seq(prompt)
        self.prefill(seq, chunk)
        self.decode([seq], new_tokens - 1)
        return seq

    @staticmethod
    def _sample(seq: Seq, logits: torch.Tensor) -> None:
        seq.logits.append(logits)
        seq.tokens.append(int(logits.argmax()))

    def check_empty(self) -> None:
        self.pool.check_integrity()
        self.states.check_integrity()
        assert self.pool.num_used == 0 and self.states.num_used == 0


def new_tokens(seq: Seq) -> list[int]:
    return seq.tokens[len(seq.tokens) - seq.generated:]


# ---- checks shared by the hybrid parity tests ---------------------------------------------

NEW_TOKENS = 32
PROMPTS = [
    "The capital of France is",
    "def reverse_string(s):",
    "Long conversations with coding agents repeat the same system prompt, the same tool "
    "definitions and most of the history on every turn, so a server that keeps the state of "
    "a conversation, and not only its attention cache, can skip recomputing the prefix. "
    "For a hybrid model that state includes recurrent and convolution states per layer.",
]
CHUNK = 7  # with 16-token pages, chunks end inside pages
TOL = 1e-4  # fp32 logits: max |ours - reference|


def _states_diff(runner: Runner, a: Seq, b: Seq) -> float:
    """Max |difference| over all conv/recurrent state tensors of two sequences' slots."""
    s_a, s_b = runner.states.read(a.slot), runner.states.read(b.slot)
    return max(float((s_a[k] - s_b[k]).abs().max()) for k in s_a)


def check_greedy_equals_transformers(make_runner, hf_model, prompts: list[list[int]],
                                     label: str) -> None:
    """Each prompt alone, one-shot prefill then 31 decode steps: tokens equal transformers'
    `generate`; logits of every sampled position within TOL of transformers' forward over
    the whole sequence (printed, with the smallest top-2 margin of the reference)."""
    runner = make_runner()
    for prompt in prompts:
        seq = runner.generate(prompt, NEW_TOKENS)
        ours = new_tokens(seq)
        ref_tokens = hf_greedy(hf_model, prompt, NEW_TOKENS)
        with torch.no_grad():
            full = torch.tensor([prompt + ref_tokens[:-1]])
            ref = hf_model(full).logits[0, len(prompt) - 1:].float()  # [32, V]
        diff = float((torch.stack(seq.logits) - ref).abs().max())
        top2 = ref.topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min())
        print(f"{label}: prompt of {len(prompt)} tokens, {NEW_TOKENS} greedy tokens, "
              f"logits max abs diff {diff:.3e} (reference's smallest top-2 margin {margin:.3e})")
        assert ours == ref_tokens
        assert diff < TOL
        runner.free(seq)
    runner.check_empty()


def check_chunked_prefill_equals_one_shot(make_runner, prompt: list[int], chunk: int,
                                          label: str) -> None:
    """Prefill in chunks of `chunk` tokens (ending inside pages) leaves the same logits and
    the same conv/recurrent states as one chunk, and decodes the same tokens."""
    runner = make_runner()
    one = runner.new_seq(prompt)
    cut = runner.new_seq(prompt)
    l_one = runner.prefill(one)
    l_cut = runner.prefill(cut, chunk=chunk)
    diff = float((l_one - l_cut).abs().max())
    sdiff = _states_diff(runner, one, cut)
    print(f"{label}: {len(prompt)} tokens in chunks of {chunk} vs one: logits max abs diff "
          f"{diff:.3e}, states max abs diff {sdiff:.3e}")
    assert diff < TOL and sdiff < TOL
    runner.decode([one], NEW_TOKENS - 1)
    runner.decode([cut], NEW_TOKENS - 1)
    assert new_tokens(one) == new_tokens(cut)
    runner.free(one)
    runner.free(cut)
    runner.check_empty()


def check_decode_path_equals_prefill(make_runner, prompt: list[int], label: str) -> None:
    """Feeding the prompt one token per step through the decode path (recurrent update)
    gives the prefill path's (chunked form) logits and states."""
    runner = make_runner()
    ref = runner.new_seq(prompt)
    l_ref = runner.prefill(ref)
    seq = runner.new_seq(prompt)
    for _ in range(len(prompt)):
        logits = runner.step([seq], [])[0]
    diff = float((l_ref - logits).abs().max())
    sdiff = _states_diff(runner, ref, seq)
    print(f"{label}: {len(prompt)} tokens by decode steps vs prefill: logits max abs diff "
          f"{diff:.3e}, states max abs diff {sdiff:.3e}")
    assert diff < TOL and sdiff < TOL
    runner.free(ref)
    runner.free(seq)
    runner.check_empty()


def check_batched_equals_alone(make_runner, prompts: list[list[int]], chunk: int,
                               label: str) -> None:
    """Sequences of different lengths stepped together (decode group of two while the third
    prefills in chunks in the same steps, then all three decoding) give each one's tokens
    alone."""
    runner = make_runner()
    alone = []
    for p in prompts:
        seq = runner.generate(p, NEW_TOKENS)
        alone.append(seq)
    a, b, c = (runner.new_seq(p) for p in prompts)
    runner.prefill(a)
    runner.prefill(b)
    while c.computed < len(c.tokens):  # mixed steps: decode a, b; a chunk of c
        n = min(chunk, len(c.tokens) - c.computed)
        rows = runner.step([a, b], [(c, n)])
        runner._sample(a, rows[0])
        runner._sample(b, rows[1])
    runner._sample(c, rows[2])
    while c.generated < NEW_TOKENS:
        group = [s for s in (a, b, c) if s.generated < NEW_TOKENS]
        for seq, row in zip(group, runner.step(group, [])):
            runner._sample(seq, row)
    diffs = []
    for ref, got in zip(alone, (a, b, c)):
        assert new_tokens(got) == new_tokens(ref)
        diffs.append(float((torch.stack(got.logits) - torch.stack(ref.logits)).abs().max()))
    print(f"{label}: batched vs alone ({[len(p) for p in prompts]} prompt tokens), "
          f"logits max abs diff {max(diffs):.3e}")
    assert max(diffs) < TOL
    for seq in (*alone, a, b, c):
        runner.free(seq)
    runner.check_empty()


def check_copied_slot_continues_identically(make_runner, prompt: list[int], chunk: int,
                                            label: str) -> None:
    """A checkpoint/branch: the state slot copied to another slot at position P (with the
    KV pages up to P) continues to the same tokens as the original, whichever runs first."""
    runner = make_runner()
    ref = runner.generate(prompt, NEW_TOKENS, chunk=chunk)
    seq = runner.new_seq(prompt)
    runner.prefill(seq, chunk=chunk)
    runner.decode([seq], 4)
    assert seq.computed % runner.page_size, "the branch point should be inside a page"
    child = runner.fork(seq)
    child.logits = list(seq.logits)
    runner.decode([seq], NEW_TOKENS - seq.generated)  # the original advances its slot first
    original = new_tokens(seq)
    runner.free(seq)  # and gives its pages and slot back: the child must not care
    runner.decode([child], NEW_TOKENS - child.generated)
    assert original == new_tokens(ref)
    assert new_tokens(child) == new_tokens(ref)
    diff = float((torch.stack(child.logits) - torch.stack(ref.logits)).abs().max())
    print(f"{label}: branch at position {len(prompt) + 4} (copied slot + shared pages) vs "
          f"straight run: logits max abs diff {diff:.3e}")
    assert diff < TOL
    runner.free(ref)
    runner.free(child)
    runner.check_empty()


# ---- the parity tests every hybrid recipe runs ---------------------------------------------

def build_tiny(recipe: str, model_cls: Any, folder: Path, tokenizer
               ) -> tuple[Path, Any, Any, list[list[int]]]:
    """Save the tiny random `recipe` checkpoint (`hybrid_models.BUILDERS`) with `tokenizer`
    into `folder`, load it as flare's `model_cls` (`from_hf`, fp32, 512 positions).

    Returns:
        (folder, transformers model, our model, `PROMPTS` as token ids).
    """
    hf_model = BUILDERS[recipe](folder, tokenizer)
    hf_config = json.loads((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    ours = model_cls.from_hf(hf_config, tensors, max_positions=512)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    return folder, hf_model, ours, prompts


def tiny_fixture(recipe: str, model_cls: Any):
    """A module-scoped fixture `tiny`: `build_tiny(recipe, model_cls, ...)` in a fresh
    folder with the embedded model's tokenizer; assign it to `tiny` in a test module."""
    @pytest.fixture(scope="module")
    def tiny(tmp_path_factory, embedded_checkpoint):
        folder = tmp_path_factory.mktemp(f"tiny-{recipe}") / f"tiny-{recipe}"
        return build_tiny(recipe, model_cls, folder, embedded_checkpoint.tokenizer)

    return tiny


class HybridParityChecks:
    """The parity tests of a hybrid recipe, over the test module's `tiny` fixture (the
    tuple of `build_tiny`). A module subclasses it as `Test...` and sets:

    Attributes:
        label: printed with each figure ("tiny-lfm2").
        recipe: the recipe's module (`state_layout`, `expected_tensor_names`).
        model_cls: its model class (`from_hf`).
        kv_layers: the model layers the tiny config gives a KV cache.
    """

    label: str
    recipe: ModuleType
    model_cls: Any
    kv_layers: tuple[int, ...]

    def test_tensor_names_and_kv_layers_match_the_saved_folder(self, tiny):
        folder, _, ours, _ = tiny
        assert set(load_file(str(folder / "model.safetensors"))) == (
            self.recipe.expected_tensor_names(ours.config))
        layout = self.recipe.state_layout(ours.config, 16, torch.bfloat16)
        assert (layout.num_kv_layers, layout.kv_layers) == (len(self.kv_layers), self.kv_layers)

    def make_runner(self, tiny):
        ours = tiny[2]
        return lambda: Runner(ours, self.recipe.state_layout(ours.config, 16, torch.float32))

    def test_greedy_tokens_equal_transformers(self, tiny):
        check_greedy_equals_transformers(self.make_runner(tiny), tiny[1], tiny[3], self.label)

    def test_chunked_prefill_equals_one_shot(self, tiny):
        check_chunked_prefill_equals_one_shot(self.make_runner(tiny), tiny[3][2], CHUNK,
                                              self.label)

    def test_decode_path_equals_prefill_path(self, tiny):
        check_decode_path_equals_prefill(self.make_runner(tiny), tiny[3][2][:40], self.label)

    def test_batched_steps_equal_each_sequence_alone(self, tiny):
        check_batched_equals_alone(self.make_runner(tiny), tiny[3], CHUNK, self.label)

    def test_state_copied_to_another_slot_continues_identically(self, tiny):
        check_copied_slot_continues_identically(self.make_runner(tiny), tiny[3][2], CHUNK,
                                                self.label)

    def test_flare_loader_reads_the_folder(self, tiny):
        from flare.loading.checkpoint import load_checkpoint

        ckpt = load_checkpoint(tiny[0])
        ours = self.model_cls.from_hf(ckpt.hf_config, ckpt.tensors, max_positions=64)
        assert set(ckpt.tensors) == self.recipe.expected_tensor_names(ours.config)
