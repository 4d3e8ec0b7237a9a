"""Prefix index: published KV pages, found again by the tokens that produced them.

Pages form a tree. A *full* page (exactly `page_size` tokens) is keyed by a chained hash
of its tokens and its parent's key, so one lookup walks a request's prompt page by page.
A *tail* page (fewer tokens: the end of a finished sequence) is a leaf under its parent's
key. At the first page that differs, any cached child sharing a prefix with the request's
next tokens can still lend those positions: the engine copies them into a fresh page
(copy-on-write), since K/V at position p depends only on tokens[0..p].

Invariants (see `check_integrity`):
- the index holds one reference on every page it lists; a page listed twice is a bug;
- a node is listed only after the step that wrote all its tokens completed (publish after
  compute: the engine publishes after the forward returns), so no reader sees a page that
  is still being written;
- only nodes whose page is held by nobody else (refcount 1) and that have no children are
  evicted (LRU), so a page in use by a sequence is never freed.
The key's root is the namespace (the package id): a page is never offered across packages.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from flare.state.pools import PagePool

log = logging.getLogger(__name__)


def page_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """Chained key of a full page: BLAKE2b-128 over the parent key and the token ids
    (int32 little-endian). Stable across processes, so a disk tier can keep it."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("i", tokens).tobytes())
    return h.digest()


def root_key(namespace: str) -> bytes:
    return hashlib.blake2b(namespace.encode(), digest_size=16).digest()


@dataclass(eq=False)
class PageNode:
    """A published page: `tokens` (its positions' token ids) under parent key `parent`."""

    page: int
    parent: bytes
    tokens: tuple[int, ...]
    key: bytes | None  # full pages only; tails are leaves and have no key
    last_used: int = 0
    children: int = 0  # nodes whose parent is this node's key


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a token sequence.

    Attributes:
        pages: full pages to adopt as they are (positions [0, len(pages) * page_size)).
        keys: their chained keys.
        partial: a page to copy the first `partial_tokens` positions from, or None.
        partial_tokens: positions lent by `partial` (0 when None).
        num_tokens: positions covered in all: len(pages) * page_size + partial_tokens.
    """

    pages: tuple[int, ...] = ()
    keys: tuple[bytes, ...] = ()
    partial: int | None = None
    partial_tokens: int = 0
    num_tokens: int = 0


@dataclass
class PrefixIndexStats:
    """Counters of the prefix index (engine stats name them)."""

    published_pages: int = 0
    evicted_pages: int = 0


class PrefixIndex:
    """Published pages of one namespace over one `PagePool`.

    Args:
        pool: the page pool whose pages are indexed (the index holds one ref on each).
        page_size: tokens per page.
        namespace: the package id; roots every key.
    """

    def __init__(self, pool: PagePool, page_size: int, namespace: str) -> None:
        self.pool = pool
        self.page_size = page_size
        self.root = root_key(namespace)
        self._full: dict[bytes, PageNode] = {}
        self._children: dict[bytes, list[PageNode]] = {}  # parent key -> child nodes
        self._clock = itertools.count(1)
        self._num_pages = 0
        self.stats = PrefixIndexStats()
        # called with each node `evict` is about to drop, while its page is still intact
        # (the host tier keeps a copy: flare.state.tiers)
        self.on_evict: Callable[[PageNode], None] | None = None

    @property
    def num_pages(self) -> int:
        """Pages the index holds (each with one reference). A plain counter, so another
        thread (the HTTP server's stats) can read it while the engine thread changes the
        index."""
        return self._num_pages

    # ---- lookup -------------------------------------------------------------------------

    def match(self, tokens: list[int], limit: int) -> PrefixMatch:
        """Longest cached prefix of `tokens[:limit]`; touches matched nodes (LRU).

        Args:
            tokens: the request's token ids.
            limit: most positions to reuse (callers pass len(tokens) - 1, so at least one
                token is computed and yields logits).
        """
        ps = self.page_size
        limit = min(limit, len(tokens))
        key, pages, keys, pos = self.root, [], [], 0
        now = next(self._clock)
        while pos + ps <= limit:
            node = self._full.get(page_key(key, tuple(tokens[pos:pos + ps])))
            if node is None:
                break
            node.last_used = now
            pages.append(node.page)
            keys.append(node.key)
            key, pos = node.key, pos + ps
        best, best_len = None, 0
        want = tokens[pos:min(pos + ps, limit)]
        for node in self._children.get(key, ()):
            n = common_prefix(node.tokens, want)
            if n > best_len:
                best, best_len = node, n
        if best is not None:
            best.last_used = now
        return PrefixMatch(tuple(pages), tuple(keys), best.page if best else None, best_len,
                           pos + best_len)

    def covers(self, parent: bytes, tail: tuple[int, ...]) -> bool:
        """Whether the pages of a prefix are all listed: the full pages keyed up to
        `parent` (a listed node's ancestors are listed too: only leaves are evicted), and,
        when `tail` is not empty, a child of `parent` whose first tokens are `tail`."""
        if parent != self.root and parent not in self._full:
            return False
        if not tail:
            return True
        n = len(tail)
        return any(node.tokens[:n] == tail for node in self._children.get(parent, ()))

    def node(self, key: bytes) -> PageNode | None:
        """The listed full page under chained key `key`, or None."""
        return self._full.get(key)

    def tail_node(self, parent: bytes, tokens: tuple[int, ...]) -> PageNode | None:
        """A listed partly filled page under `parent` whose first tokens are `tokens`."""
        n = len(tokens)
        return next((node for node in self._children.get(parent, ())
                     if node.key is None and node.tokens[:n] == tokens), None)

    # ---- publish ------------------------------------------------------------------------

    def publish_full(self, parent: bytes, tokens: tuple[int, ...], page: int) -> tuple[bytes, int]:
        """List a full page the caller holds and has finished writing.

        Returns:
            (key, page to use from now on). When an equal page is already listed, that one
            is returned with a new reference for the caller, and the caller's `page` is
            released: the caller must replace it in its page table.
        """
        assert len(tokens) == self.page_size
        key = page_key(parent, tokens)
        node = self._full.get(key)
        if node is not None:
            self.pool.incref([node.page])
            self.pool.release([page])
            node.last_used = next(self._clock)
            return key, node.page
        self.pool.incref([page])
        node = PageNode(page, parent, tokens, key, next(self._clock))
        self._add(node)
        self._full[key] = node
        self.stats.published_pages += 1
        return key, page

    def publish_tail(self, parent: bytes, tokens: tuple[int, ...], page: int) -> bool:
        """List a finished sequence's last, partly filled page (the caller stops writing it).

        The index takes a new reference. Nothing is listed when a cached child of `parent`
        already covers `tokens` (returns False).
        """
        assert 0 < len(tokens) < self.page_size
        for node in self._children.get(parent, ()):
            if node.tokens[:len(tokens)] == tokens:
                node.last_used = next(self._clock)
                return False
        self.pool.incref([page])
        self._add(PageNode(page, parent, tokens, None, next(self._clock)))
        self.stats.published_pages += 1
        return True

    def _add(self, node: PageNode) -> None:
        self._num_pages += 1
        self._children.setdefault(node.parent, []).append(node)
        parent = self._full.get(node.parent)
        if parent is not None:
            parent.children += 1

    # ---- evict --------------------------------------------------------------------------

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages, least recently used first, among leaves that no
        sequence holds. Returns how many pages went back to the pool."""
        freed = 0
        while freed < num_pages:
            victims = [n for nodes in self._children.values() for n in nodes
                       if n.children == 0 and self.pool.refcount(n.page) == 1]
            if not victims:
                break
            victims.sort(key=lambda n: n.last_used)
            for node in victims[:num_pages - freed]:
                if self.on_evict is not None:
                    self._demote(node)
                self._remove(node)
                freed += 1
        self.stats.evicted_pages += freed
        return freed

    def _demote(self, node: PageNode) -> None:
        try:
            self.on_evict(node)
        except Exception:  # a lost copy costs a recompute later, never the eviction
            log.exception("demotion of an evicted page failed")

    def _remove(self, node: PageNode) -> None:
        self._num_pages -= 1
        siblings = self._children[node.parent]
        siblings.remove(node)
        if not siblings:
            del self._children[node.parent]
        parent = self._full.get(node.parent)
        if parent is not None:
            parent.children -= 1
        if node.key is not None:
            del self._full[node.key]
        self.pool.release([node.page])

    def clear(self) -> int:
        """Drop every node no sequence holds (leaves first); returns pages released."""
        total = 0
        while True:
            n = self.evict(self.pool.num_pages)
            total += n
            if n == 0:
                return total

    def check_integrity(self) -> None:
        """Assert the index's invariants.

        Raises:
            AssertionError: a page listed twice or not held, a child count that is wrong,
                a full node missing from the key map.
        """
        seen: set[int] = set()
        counts: dict[bytes, int] = {}
        for parent, nodes in self._children.items():
            for n in nodes:
                assert n.parent == parent
                assert n.page not in seen, f"page {n.page} listed twice"
                seen.add(n.page)
                assert self.pool.refcount(n.page) >= 1, f"listed page {n.page} is free"
                if n.key is not None:
                    assert self._full.get(n.key) is n, "full node missing from key map"
                counts[parent] = counts.get(parent, 0) + 1
        for key, node in self._full.items():
            assert node.children == counts.get(key, 0), f"child count of {key.hex()}"
        assert self._num_pages == len(seen), "page counter differs from the listed pages"

    def held_pages(self) -> list[int]:
        return [n.page for nodes in self._children.values() for n in nodes]


def common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    """How many leading token ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
