"""Device pool of per-sequence conv / recurrent states of hybrid layers, allocated once.

A *state slot* is one index into every hybrid layer's state tensors: slot `s` of the pool
is the whole non-KV state of one sequence (or of one checkpoint) at one token position.
The forward of a hybrid recipe reads and updates the slots named in its `AttentionBatch`
in place; a checkpoint is `copy(live_slot, checkpoint_slot)` taken between two steps.
Like `PagePool`, the pool knows nothing of requests: it hands out indices and keeps the
tensors they point into.
"""

from __future__ import annotations

import torch

from flare.state.layout import StateLayout
from flare.state.pools import FreeListCounts, PoolExhausted


class StateSlotPool(FreeListCounts):
    """`num_slots` state slots for every hybrid layer of a `StateLayout`.

    Layout: for each spec in `layout.layer_states`, `conv[spec.layer]` is a
    `[num_slots, *spec.conv_shape]` tensor of `spec.conv_dtype` and `recurrent[spec.layer]`
    a `[num_slots, *spec.recurrent_shape]` tensor of `spec.recurrent_dtype` (only the kinds
    the layer has). Keys are model layer indices.

    Invariants (checked by `check_integrity`): every slot is either free (on the free
    list exactly once) or allocated (not on it). Slots have a single owner: a branch or a
    checkpoint gets its own slot and a `copy`, never a shared one (the forward updates a
    slot in place).

    Args:
        layout: the recipe's state layout (its `layer_states` give the shapes).
        num_slots: slots to allocate (live sequences + checkpoint slots of the plan).
        device: where the state tensors live.

    Raises:
        ValueError: `num_slots` < 1, or a layout without hybrid layers.
    """

    def __init__(self, layout: StateLayout, num_slots: int,
                 device: torch.device | str = "cpu") -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if not layout.layer_states:
            raise ValueError("the state layout has no conv or recurrent layers (KV-only "
                             "recipe): it needs no state slots")
        self.layout = layout
        self.num_slots = self._size = num_slots
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        for spec in layout.layer_states:
            if spec.conv_shape:
                self.conv[spec.layer] = torch.zeros(
                    (num_slots, *spec.conv_shape), dtype=spec.conv_dtype, device=device)
            if spec.recurrent_shape:
                self.recurrent[spec.layer] = torch.zeros(
                    (num_slots, *spec.recurrent_shape), dtype=spec.recurrent_dtype,
                    device=device)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives 0 first
        self._used = [False] * num_slots

    # ---- accounting (num_free, num_used: `FreeListCounts`) -----------------------------

    @property
    def bytes_per_slot(self) -> int:
        """Bytes of one slot over all layers (equals `layout.state_bytes_per_slot`)."""
        return self.layout.state_bytes_per_slot

    @property
    def nbytes(self) -> int:
        """Bytes of all state tensors (what the memory report must count)."""
        return sum(t.nbytes for t in self._tensors())

    def is_allocated(self, slot: int) -> bool:
        return 0 <= slot < self.num_slots and self._used[slot]

    def allocate(self) -> int:
        """Take a free slot, zeroed (the state before a sequence's first token).

        Raises:
            PoolExhausted: no slot is free (nothing is taken).
        """
        if not self._free:
            raise PoolExhausted(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        self._used[slot] = True
        self.zero(slot)
        return slot

    def release(self, slot: int) -> None:
        """Return an allocated slot to the free list (its contents are left as they are).

        Raises:
            ValueError: the slot is out of range or already free (a double free is a bug).
        """
        self._check(slot, "release")
        self._used[slot] = False
        self._free.append(slot)

    # ---- contents -----------------------------------------------------------------------

    def zero(self, slot: int) -> None:
        """Reset an allocated slot to the empty state (position 0)."""
        self._check(slot, "zero")
        for t in self._tensors():
            t[slot].zero_()

    def copy(self, src: int, dst: int) -> None:
        """Make `dst` hold the state of `src`, in every layer (a checkpoint, a branch or a
        restore). Both must be allocated. On CUDA the copy is queued on the current stream,
        so it sees every step queued before it and is seen by every step queued after.

        Raises:
            ValueError: a slot is free or out of range.
        """
        self._check(src, "copy from")
        self._check(dst, "copy to")
        if src == dst:
            return
        for t in self._tensors():
            t[dst].copy_(t[src])

    def read(self, slot: int, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """A copy of one slot's tensors, named `conv.{layer}` / `recurrent.{layer}` (for
        offload to host or disk, e.g. with safetensors).

        Raises:
            ValueError: the slot is free or out of range.
        """
        self._check(slot, "read")
        out = {f"conv.{i}": t[slot].to(device, copy=True) for i, t in self.conv.items()}
        out |= {f"recurrent.{i}": t[slot].to(device, copy=True)
                for i, t in self.recurrent.items()}
        return out

    def write(self, slot: int, tensors: dict[str, torch.Tensor]) -> None:
        """Restore one slot from `read`'s output (all names, matching shapes and dtypes).

        Raises:
            ValueError: the slot is free, or `tensors` does not match the layout (named);
                nothing is written then.
        """
        self._check(slot, "write")
        targets = {f"conv.{i}": t for i, t in self.conv.items()}
        targets |= {f"recurrent.{i}": t for i, t in self.recurrent.items()}
        if set(tensors) != set(targets):
            raise ValueError(f"state tensors do not match the layout: missing "
                             f"{sorted(set(targets) - set(tensors))}, unexpected "
                             f"{sorted(set(tensors) - set(targets))}")
        for name, t in targets.items():
            src = tensors[name]
            if tuple(src.shape) != tuple(t.shape[1:]) or src.dtype != t.dtype:
                raise ValueError(f"state tensor {name}: {tuple(src.shape)} {src.dtype}, "
                                 f"expected {tuple(t.shape[1:])} {t.dtype}")
        for name, t in targets.items():
            t[slot].copy_(tensors[name])

    def check_integrity(self) -> None:
        """Assert the pool's invariants.

        Raises:
            AssertionError: a slot is free and used, on the free list twice, or lost.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a slot is on the free list twice"
        assert all(0 <= s < self.num_slots for s in free), "a free slot is out of range"
        for s, used in enumerate(self._used):
            assert used != (s in free), f"slot {s}: used {used}, on free list {s in free}"
        for t in self._tensors():
            assert t.shape[0] == self.num_slots, "a state tensor lost its slot axis"

    # ---- helpers ------------------------------------------------------------------------

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.conv.values(), *self.recurrent.values()]

    def _check(self, slot: int, what: str) -> None:
        if not self.is_allocated(slot):
            state = "out of range" if not 0 <= slot < self.num_slots else "free"
            raise ValueError(f"{what} state slot {slot}: {state}")
