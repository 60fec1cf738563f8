"""Cache pages: who holds which page, and (with prefix caching) which pages hold what.

Every page has a reference count: the requests whose block tables list it. A page nobody
holds goes back to the free list — unless prefix caching is on and the page is *full* of
known tokens, in which case it stays in the cache, findable by the hash of its tokens chained
with the hash of everything before it, until the allocator needs it back (least recently
released first).

The hash chain makes a page's key depend on the whole prefix: two requests share page ``i``
only if their first ``(i + 1) * page_size`` tokens are equal. SHA-256 keeps the chance of two
different prefixes sharing a key out of reach, so a hit is exact.

One page id indexes every per-page cache tensor (each layer's latent rows and, for DSA models,
its indexer-key rows), so sharing a page shares all of them.

With ``lookahead=1`` (speculative decoding) a page's key also covers the token after it: the
MTP layer's row at a page's last slot is made from that next token too, so two requests may
share the page only if they agree on it. A page becomes findable once that token is known.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = b""  # the chain's start: the hash "before" a request's first page


def page_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full page: SHA-256 of its parent's key and its token ids."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockManager:
    """Reference-counted cache pages, with an optional prefix cache.

    Args:
        num_pages: pages in the cache.
        page_size: tokens per page.
        prefix_caching: keep released full pages findable by :meth:`match_prefix`.
        lookahead: tokens past a page's end that its key covers (0, or 1 for speculative
            decoding: see the module docstring).
    """

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = False, lookahead: int = 0):
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        self.lookahead = lookahead
        self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: page 0 first
        self._refs = [0] * num_pages
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        # cached pages nobody holds, oldest release first: evicted in this order
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.num_evicted = 0  # cached pages taken back by allocations, so far

    @property
    def num_free(self) -> int:
        """Pages an allocation can get: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Pages findable by their hash (held or not)."""
        return len(self._by_hash)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """``n`` pages for one holder: free pages first, then the least recently released
        cached pages (forgotten by the cache)."""
        if n > self.num_free:
            raise RuntimeError(f"page allocator: asked for {n} pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(page)]
                self.num_evicted += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Releases one holder's pages. Pages are released last first, so that under memory
        pressure a cached prefix loses its tail before its head (a tail is useless without it)."""
        for page in reversed(pages):
            if self._refs[page] <= 0:
                raise RuntimeError(f"page allocator: page {page} released more often than held")
            self._refs[page] -= 1
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._evictable[page] = None
                else:
                    self._free.append(page)

    def match_prefix(self, tokens: Sequence[int], max_pages: int) -> tuple[list[int], list[bytes]]:
        """The longest run of cached pages holding ``tokens`` from the start (at most
        ``max_pages``): the pages, now also held by the caller, and their hashes."""
        pages: list[int] = []
        hashes: list[bytes] = []
        if not self.prefix_caching:
            return pages, hashes
        parent, ps, la = ROOT_HASH, self.page_size, self.lookahead
        for i in range(min(max_pages, (len(tokens) - la) // ps)):
            h = page_hash(parent, tokens[i * ps : (i + 1) * ps + la])
            page = self._by_hash.get(h)
            if page is None:
                break
            pages.append(page)
            hashes.append(h)
            parent = h
        for page in pages:
            if self._refs[page] == 0:
                del self._evictable[page]
            self._refs[page] += 1
        return pages, hashes

    def cache_full_pages(self, pages: Sequence[int], tokens: Sequence[int], num_computed: int, hashes: list[bytes]) -> None:
        """Makes a holder's pages that are full of computed tokens findable.

        ``tokens[:num_computed]`` are in the cache at ``pages``; ``hashes`` holds the hashes
        of the pages already handled, and is extended in place. A page whose tokens are cached
        already (another request computed the same prefix at the same time) stays private and
        goes back to the free list when released; its hash still extends the chain.
        """
        if not self.prefix_caching:
            return
        ps, la = self.page_size, self.lookahead
        parent = hashes[-1] if hashes else ROOT_HASH
        for i in range(len(hashes), min(num_computed, len(tokens) - la) // ps):
            h = page_hash(parent, tokens[i * ps : (i + 1) * ps + la])
            if h not in self._by_hash and pages[i] not in self._hash_of:
                self._by_hash[h] = pages[i]
                self._hash_of[pages[i]] = h
            hashes.append(h)
            parent = h

    def clear_cache(self) -> int:
        """Forgets every cached page nobody holds (they become free); returns how many."""
        n = len(self._evictable)
        while self._evictable:
            page, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash_of.pop(page)]
            self._free.append(page)
        return n
