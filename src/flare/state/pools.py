"""Device pools allocated once at start-up: KV pages and their accounting.

`PagePool` hands out page indices and counts references (a page shared by several
sequences or cached prefixes is freed only when its last holder lets go). `KVCache` owns
the K and V tensors those indices point into. Neither knows about requests or HTTP.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sized

import torch

from flare.state.layout import StateLayout


class PoolExhausted(RuntimeError):
    """Raised when an allocation asks for more pages than are free."""


class FreeListCounts:
    """`num_free` and `num_used` of a pool of `_size` entries whose free ones are listed
    in `_free` (the page pool here, the state slot pool in `flare.state.slots`)."""

    _size: int
    _free: Sized

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._size - len(self._free)


class PagePool(FreeListCounts):
    """A free list of `num_pages` page indices with reference counts.

    Invariants (checked by `check_integrity`): every page is either free (refcount 0, on
    the free list exactly once) or held (refcount >= 1, not on the free list).
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = self._size = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refcount = [0] * num_pages

    def allocate(self, n: int) -> list[int]:
        """Take `n` free pages, each with refcount 1.

        Raises:
            PoolExhausted: fewer than `n` pages are free (nothing is taken).
        """
        if n > len(self._free):
            raise PoolExhausted(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        """Add a holder to pages that are already held."""
        for p in pages:
            if self._refcount[p] < 1:
                raise ValueError(f"incref of free page {p}")
            self._refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one holder from each page; a page whose last holder left becomes free.

        Raises:
            ValueError: a page is already free (a double free is a bug, never ignored).
        """
        for p in pages:
            if self._refcount[p] < 1:
                raise ValueError(f"release of free page {p}")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def check_integrity(self) -> None:
        """Assert the pool's invariants; cheap enough for every accounting test.

        Raises:
            AssertionError: a page is free and held, on the free list twice, or lost.
        """
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        for p, rc in enumerate(self._refcount):
            assert rc >= 0, f"page {p} has refcount {rc}"
            assert (rc == 0) == (p in free), f"page {p}: refcount {rc}, on free list {p in free}"


class KVCache:
    """K and V for every KV layer, in pages, allocated once.

    Layout: `k[layer]` and `v[layer]` are `[num_pages * page_size, num_kv_heads, head_dim]`
    tensors of `layout.dtype`; token position `pos` of a sequence whose page table is
    `pages` lives in slot `pages[pos // page_size] * page_size + pos % page_size`.
    `k_layers[layer]` / `v_layers[layer]` are those per-layer views, made once (a forward
    step would otherwise pay for 2 x layers view ops; `k` and `v` are never reassigned).

    Padding page: with `padding_pages=1` the tensors hold one page more, index
    `num_pages` (`padding_page`), which the page pool never hands out. The fixed-shape
    decode step (`flare.runtime.cuda_graphs`) writes the K/V of its padding rows there and
    points unused block-table entries at it, so padding never touches a real page.
    """

    def __init__(self, layout: StateLayout, num_pages: int, device: torch.device | str,
                 padding_pages: int = 0) -> None:
        if padding_pages not in (0, 1):
            raise ValueError(f"padding_pages must be 0 or 1, got {padding_pages}")
        self.layout = layout
        self.page_size = layout.page_size
        self.num_pages = num_pages
        self.padding_page: int | None = num_pages if padding_pages else None
        slots = (num_pages + padding_pages) * layout.page_size
        shape = (layout.num_kv_layers, slots, layout.num_kv_heads, layout.head_dim)
        self.k = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.v = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """Slot indices of token positions [start, end) of a sequence with page table `pages`.

        Returns an int64 tensor of shape [end - start] (contiguous).
        """
        ps = self.page_size
        first = start // ps
        # whole pages of slots, then the [start, end) window: O(pages) work, few ops
        table = torch.tensor(pages[first:-(-end // ps)], dtype=torch.int64)
        full = (table[:, None] * ps + torch.arange(ps, dtype=torch.int64)).view(-1)
        return full[start - first * ps:end - first * ps]

    def copy_page_prefix(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy K/V of the first `num_tokens` positions of page `src` into page `dst`, in
        every layer (copy-on-write of a shared page before a sequence writes into it)."""
        a, b = src * self.page_size, dst * self.page_size
        self.k[:, b:b + num_tokens] = self.k[:, a:a + num_tokens]
        self.v[:, b:b + num_tokens] = self.v[:, a:a + num_tokens]
