"""Keys and host copies of the state parts the tiers below the device pools hold.

A tier record (`flare.state.disk_records.StateRecord`) is one KV page, one partly filled
page (a tail) or one hybrid layer-state checkpoint. Records are keyed like the prefix
index (chained BLAKE2b keys rooted in the package id), so a key made by one package is
never found by another, and keys survive a restart.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING

from flare.state.disk_records import StateRecord

if TYPE_CHECKING:
    from flare.state.checkpoints import Checkpoint
    from flare.state.pools import KVCache
    from flare.state.prefix_index import PageNode
    from flare.state.slots import StateSlotPool

PAGE, TAIL, CHECKPOINT = "page", "tail", "checkpoint"


def _key(tag: bytes, parent: bytes, tokens: tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(tag + parent, digest_size=16)
    h.update(array("i", tokens).tobytes())
    return h.digest()


def tail_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """Key of a partly filled page of `tokens` under `parent` (BLAKE2b-128)."""
    return _key(b"tail", parent, tokens)


def checkpoint_key(parent: bytes, tail: tuple[int, ...]) -> bytes:
    """Key of a layer-state checkpoint at `parent`'s pages plus `tail` (BLAKE2b-128)."""
    return _key(b"ckpt", parent, tail)


def page_record(kv: KVCache, node: PageNode) -> StateRecord:
    """A host copy of a published page: K and V of its positions in every KV layer,
    tensors `k`, `v` of shape [num_kv_layers, len(node.tokens), num_kv_heads, head_dim]."""
    a, n = node.page * kv.page_size, len(node.tokens)
    kind = PAGE if node.key is not None else TAIL
    key = node.key if node.key is not None else tail_key(node.parent, node.tokens)
    tensors = {"k": kv.k[:, a:a + n].to("cpu", copy=True),
               "v": kv.v[:, a:a + n].to("cpu", copy=True)}
    # position 0: a page is placed by its key chain, not by a position
    return StateRecord(kind, key, node.parent, node.tokens, 0, tensors)


def checkpoint_record(states: StateSlotPool, ckpt: Checkpoint) -> StateRecord:
    """A host copy of a checkpoint: every layer state at `ckpt.position` (`states.read`)."""
    return StateRecord(CHECKPOINT, checkpoint_key(ckpt.parent, ckpt.tail), ckpt.parent,
                       ckpt.tail, ckpt.position, states.read(ckpt.slot))
