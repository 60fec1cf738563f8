"""BlockManager: reference counts, the prefix cache's hash chain, LRU eviction, and that no
page is ever lost or handed out twice (a random workload checked against a simple model)."""

from __future__ import annotations

import random

import pytest

from mlagraph.engine.block_manager import ROOT_HASH, BlockManager, page_hash

PS = 4


def _run_request(bm: BlockManager, tokens: list[int]) -> tuple[list[int], int]:
    """What the engine does for one prompt: match, allocate the rest, compute, cache, release
    later. Returns (pages, matched tokens)."""
    matched, hashes = bm.match_prefix(tokens, max_pages=(len(tokens) - 1) // PS)
    need = -(-len(tokens) // PS) - len(matched)
    pages = matched + bm.allocate(need)
    bm.cache_full_pages(pages, tokens, len(tokens), hashes)
    assert len(hashes) == len(tokens) // PS
    return pages, len(matched) * PS


def test_without_prefix_caching_it_is_a_free_list():
    bm = BlockManager(6, PS)
    a = bm.allocate(4)
    assert a == [0, 1, 2, 3] and bm.num_free == 2
    bm.cache_full_pages(a, list(range(16)), 16, hashes := [])
    assert bm.num_cached == 0 and hashes == []
    bm.free(a)
    assert bm.num_free == 6 and bm.match_prefix(list(range(16)), 4) == ([], [])
    with pytest.raises(RuntimeError, match="asked for 7 pages, 6 free"):
        bm.allocate(7)


def test_hash_chains_over_the_prefix():
    page = [1, 2, 3, 4]
    h1 = page_hash(ROOT_HASH, page)
    assert page_hash(ROOT_HASH, page) == h1 and len(h1) == 32
    assert page_hash(h1, page) != h1  # the same tokens after a different prefix: a different key
    assert page_hash(ROOT_HASH, [1, 2, 3, 5]) != h1


def test_shared_prefix_is_found_held_and_counted():
    bm = BlockManager(16, PS, prefix_caching=True)
    a_tokens = list(range(10))  # pages [0..3], [4..7] full; [8, 9] partial
    a, hit = _run_request(bm, a_tokens)
    assert hit == 0 and bm.num_cached == 2
    b_tokens = list(range(8)) + [50, 51, 52]  # same two first pages, then different
    b, hit = _run_request(bm, b_tokens)
    assert hit == 8 and b[:2] == a[:2] and b[2] not in a
    assert [bm.ref_count(p) for p in a] == [2, 2, 1]
    c, hit = _run_request(bm, [0, 1, 2, 3, 9, 9, 9, 9, 9])  # only the first page matches
    assert hit == 4 and c[0] == a[0] and c[1] != a[1]
    assert _run_request(bm, [7] + list(range(1, 12)))[1] == 0  # first token differs: nothing


def test_a_match_leaves_the_last_token_to_compute():
    bm = BlockManager(8, PS, prefix_caching=True)
    tokens = list(range(8))  # exactly two full pages
    a, _ = _run_request(bm, tokens)
    bm.free(a)
    pages, hashes = bm.match_prefix(tokens, max_pages=(len(tokens) - 1) // PS)
    assert pages == [a[0]] and len(hashes) == 1  # page 2 would leave nothing to compute


def test_released_cached_pages_stay_findable_until_evicted_lru():
    bm = BlockManager(6, PS, prefix_caching=True)
    a, _ = _run_request(bm, list(range(8)) + [99])  # 3 pages, 2 cached
    b, _ = _run_request(bm, list(range(100, 108)) + [99])  # 3 pages, 2 cached
    bm.free(a)
    bm.free(b)
    assert bm.num_free == 6 and bm.num_cached == 4  # cached pages count as free
    # 2 pages come from the free list (the partial pages), then LRU eviction: a's tail first
    got = bm.allocate(3)
    assert set(got[:2]) == {a[2], b[2]} and got[2] == a[1]
    assert bm.num_cached == 3
    pages, _ = bm.match_prefix(list(range(8)) + [99], max_pages=2)
    assert pages == [a[0]]  # a's head survived its tail
    pages_b, _ = bm.match_prefix(list(range(100, 108)) + [99], max_pages=2)
    assert pages_b == b[:2]


def test_matching_a_released_page_takes_it_off_the_eviction_list():
    bm = BlockManager(3, PS, prefix_caching=True)
    a, _ = _run_request(bm, list(range(5)))
    bm.free(a)
    held, _ = bm.match_prefix(list(range(5)), max_pages=1)
    assert held == [a[0]] and bm.ref_count(a[0]) == 1 and bm.num_free == 2
    assert a[0] not in bm.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 1 pages, 0 free"):
        bm.allocate(1)


def test_the_same_prefix_computed_twice_at_once_keeps_one_copy():
    bm = BlockManager(8, PS, prefix_caching=True)
    tokens = list(range(9))
    a = bm.allocate(3)
    b = bm.allocate(3)
    bm.cache_full_pages(a, tokens, 9, ha := [])
    bm.cache_full_pages(b, tokens, 9, hb := [])
    assert ha == hb and bm.num_cached == 2
    bm.free(b)
    assert bm.num_free == 2 + 3  # b's pages were private: straight back to the free list
    bm.free(a)
    assert bm.match_prefix(tokens, 2)[0] == a[:2]


def test_double_free_is_an_error():
    bm = BlockManager(2, PS)
    a = bm.allocate(1)
    bm.free(a)
    with pytest.raises(RuntimeError, match="released more often than held"):
        bm.free(a)


def test_clear_cache_frees_unheld_cached_pages_only():
    bm = BlockManager(8, PS, prefix_caching=True)
    a, _ = _run_request(bm, list(range(9)))
    b, _ = _run_request(bm, list(range(20, 29)))
    bm.free(a)
    assert bm.clear_cache() == 2 and bm.num_cached == 2  # b's pages are held: kept
    assert bm.match_prefix(list(range(9)), 2) == ([], [])


def test_random_workload_never_loses_a_page_or_shares_different_tokens():
    """Many requests over a few shared prefixes, released in random order under pressure:
    reference counts always equal the holders, and a page held by several requests is full
    and holds the same tokens for all of them (what makes a hit exact)."""
    rnd = random.Random(0)
    bm = BlockManager(40, PS, prefix_caching=True)
    stems = [[rnd.randrange(50) for _ in range(12)] for _ in range(3)]
    live: list[tuple[list[int], list[int]]] = []  # (pages, tokens)
    hits = 0
    for _ in range(300):
        if live and (rnd.random() < 0.45 or bm.num_free < 6):
            pages, _ = live.pop(rnd.randrange(len(live)))
            bm.free(pages)
        else:
            tokens = rnd.choice(stems)[: rnd.randrange(1, 13)] + [rnd.randrange(50) for _ in range(rnd.randrange(1, 8))]
            pages, hit = _run_request(bm, tokens)
            hits += hit > 0
            live.append((pages, tokens))
        contents: dict[int, list[tuple[int, ...]]] = {}
        for pages, tokens in live:
            for i, p in enumerate(pages):
                contents.setdefault(p, []).append(tuple(tokens[i * PS : (i + 1) * PS]))
        for p in range(bm.num_pages):
            assert bm.ref_count(p) == len(contents.get(p, []))
        for p, seen in contents.items():
            if len(seen) > 1:
                assert len(set(seen)) == 1 and len(seen[0]) == PS, (p, seen)
        assert bm.num_free == bm.num_pages - len(contents)
    assert hits > 50
