"""State-slot pool accounting: slots are allocated zeroed, released once, copied whole
(every layer, conv and recurrent), read/written for offload; bytes match the layout."""

from __future__ import annotations

import pytest
import torch

from flare.state.layout import LayerStateSpec, StateLayout
from flare.state.pools import PoolExhausted
from flare.state.slots import StateSlotPool


def _layout(dtype: torch.dtype = torch.bfloat16) -> StateLayout:
    # layers 0 and 2: DeltaNet-like (conv + fp32 recurrent); layer 3: LFM2-like (conv only)
    return StateLayout(
        num_kv_layers=1, num_kv_heads=2, head_dim=8, page_size=16, dtype=dtype,
        kv_layers=(1,),
        layer_states=(
            LayerStateSpec(0, conv_shape=(12, 3), conv_dtype=dtype, recurrent_shape=(2, 4, 3)),
            LayerStateSpec(2, conv_shape=(12, 3), conv_dtype=dtype, recurrent_shape=(2, 4, 3)),
            LayerStateSpec(3, conv_shape=(6, 2), conv_dtype=dtype),
        ))


def _fill(pool: StateSlotPool, slot: int, value: float) -> None:
    for t in (*pool.conv.values(), *pool.recurrent.values()):
        t[slot].fill_(value)


def test_shapes_dtypes_and_bytes_follow_the_layout():
    layout = _layout()
    pool = StateSlotPool(layout, num_slots=5)
    assert set(pool.conv) == {0, 2, 3} and set(pool.recurrent) == {0, 2}
    assert pool.conv[0].shape == (5, 12, 3) and pool.conv[0].dtype == torch.bfloat16
    assert pool.recurrent[2].shape == (5, 2, 4, 3) and pool.recurrent[2].dtype == torch.float32
    per_slot = 2 * (12 * 3 * 2 + 2 * 4 * 3 * 4) + 6 * 2 * 2
    assert layout.state_bytes_per_slot == pool.bytes_per_slot == per_slot
    assert pool.nbytes == 5 * per_slot
    assert layout.is_hybrid and not StateLayout(1, 1, 1, 16, torch.float32).is_hybrid
    d = layout.describe()
    assert d["kv_layers"] == [1] and d["state_bytes_per_slot"] == per_slot
    assert d["layer_states"][2] == {"layer": 3, "conv_shape": [6, 2], "conv_dtype": "bfloat16",
                                    "recurrent_shape": [], "recurrent_dtype": "float32"}


def test_allocate_zeroes_release_returns_and_exhaustion_takes_nothing():
    pool = StateSlotPool(_layout(), num_slots=3)
    slots = [pool.allocate() for _ in range(3)]
    assert sorted(slots) == [0, 1, 2] and pool.num_free == 0 and pool.num_used == 3
    with pytest.raises(PoolExhausted):
        pool.allocate()
    _fill(pool, slots[1], 7.0)
    pool.release(slots[1])
    pool.check_integrity()
    again = pool.allocate()
    assert again == slots[1]
    assert all(float(t[again].abs().max()) == 0 for t in pool.recurrent.values())
    assert all(float(t[again].abs().max()) == 0 for t in pool.conv.values())
    pool.check_integrity()


def test_double_release_and_use_of_free_slots_are_refused():
    pool = StateSlotPool(_layout(), num_slots=2)
    s = pool.allocate()
    pool.release(s)
    with pytest.raises(ValueError, match="free"):
        pool.release(s)
    with pytest.raises(ValueError, match="free"):
        pool.copy(s, s)
    with pytest.raises(ValueError, match="out of range"):
        pool.release(5)
    pool.check_integrity()
    assert pool.num_free == 2


def test_copy_is_a_whole_independent_snapshot():
    pool = StateSlotPool(_layout(), num_slots=3)
    live, ckpt, other = pool.allocate(), pool.allocate(), pool.allocate()
    _fill(pool, live, 1.5)
    _fill(pool, other, -2.0)
    pool.copy(live, ckpt)
    _fill(pool, live, 3.0)  # the sequence moves on; the checkpoint must not
    for t in (*pool.conv.values(), *pool.recurrent.values()):
        assert torch.all(t[ckpt] == 1.5) and torch.all(t[other] == -2.0)
    pool.release(live)
    pool.check_integrity()


def test_read_write_roundtrip_for_offload_and_restore():
    pool = StateSlotPool(_layout(), num_slots=2)
    a, b = pool.allocate(), pool.allocate()
    for i, t in enumerate((*pool.conv.values(), *pool.recurrent.values())):
        t[a].copy_(torch.randn(t[a].shape).to(t.dtype) + i)
    saved = pool.read(a)
    assert set(saved) == {"conv.0", "conv.2", "conv.3", "recurrent.0", "recurrent.2"}
    pool.write(b, saved)
    for t in (*pool.conv.values(), *pool.recurrent.values()):
        assert torch.equal(t[a], t[b])
    with pytest.raises(ValueError, match="missing"):
        pool.write(b, {k: v for k, v in saved.items() if k != "conv.3"})
    bad = dict(saved, **{"recurrent.0": saved["recurrent.0"].to(torch.bfloat16)})
    with pytest.raises(ValueError, match="recurrent.0"):
        pool.write(b, bad)


def test_kv_only_layout_needs_no_pool():
    with pytest.raises(ValueError, match="KV-only"):
        StateSlotPool(StateLayout(2, 2, 8, 16, torch.float32), num_slots=4)
    with pytest.raises(ValueError, match="num_slots"):
        StateSlotPool(_layout(), num_slots=0)
