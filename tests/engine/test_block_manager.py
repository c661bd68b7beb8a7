"""Unit tests of jspec.engine.block_manager.BlockManager (plain Python, no jax).

What is pinned down here (module docstring of block_manager.py, docs/architecture.md):
- pages are handed out lowest id first from the never-hashed free stack; freed pages
  come back in the order the allocator documents;
- ensure_slots grows a sequence to hold n slots, or changes nothing and returns False;
- ref counts: a prefix page shared by two sequences stays allocated until both let go;
- only *full* pages of *committed* tokens (below num_final) get a hash, sha256 chained on
  the parent page's hash; with hash_next_token the hash also covers the page's next token;
  a request's cache_salt starts its own chain;
- allocate_prefix attaches the longest hashed prefix, always leaves at least one token to
  compute, and drops the last hit when asked (EAGLE-style drafters);
- freed hashed pages stay revivable (LRU); allocation takes never-hashed pages first and
  evicts the least recently freed cached page only when it must;
- hits / queries count cached pages served and full prompt pages looked up.
"""

from __future__ import annotations

import pytest

from jspec.engine.block_manager import BlockManager
from jspec.engine.sequence import Sequence
from jspec.sampling_params import SamplingParams

PS = 4  # page size used throughout


def make_seq(tokens, arrival=0, rid=None) -> Sequence:
    return Sequence(request_id=rid or f"r{arrival}", prompt_token_ids=list(tokens), params=SamplingParams(),
                    seed=0, arrival=arrival)


def toks(start, n):
    return list(range(start, start + n))


def chain_hashes(t, n_pages):
    """The chain: chain_hash(parent, page tokens), parent None for an unsalted first page."""
    hs, parent = [], None
    for i in range(n_pages):
        parent = BlockManager.chain_hash(parent, t[i * PS:(i + 1) * PS])
        hs.append(parent)
    return hs


def run_prefill(bm: BlockManager, seq: Sequence):
    """What the engine does for a sequence whose prompt was just computed: reserve its slots,
    mark them computed, hash the full pages."""
    assert bm.ensure_slots(seq, seq.num_tokens)
    seq.num_computed = seq.num_tokens
    bm.commit(seq, seq.num_computed)


# ---- hashing -----------------------------------------------------------------------------


def test_page_hash_is_sha256_of_the_parent_hash_and_the_tokens():
    """Computed here independently: sha256(parent's 32 bytes + each token as 8 bytes), the
    first page's parent a fixed root. A collision-resistant hash, since a hit is taken on the
    hash alone (a 64-bit hash of a tuple can be made to collide by a crafted prompt)."""
    import hashlib
    import struct

    root = hashlib.sha256(b"jspec prefix cache").digest()
    t = toks(7, 8)
    h0 = hashlib.sha256(root + struct.pack("=4q", *t[:4])).digest()
    h1 = hashlib.sha256(h0 + struct.pack("=4q", *t[4:])).digest()
    assert chain_hashes(t, 2) == [h0, h1]
    salted = hashlib.sha256(hashlib.sha256(root + b"tenant").digest() + struct.pack("=4q", *t[:4])).digest()
    assert BlockManager.chain_hash(BlockManager.root_hash("tenant"), t[:4]) == salted


def test_cache_salt_isolates_cached_prefixes():
    """vLLM's cache_salt: a request shares cached pages only with requests of the same salt
    (no salt being a salt of its own)."""
    bm = BlockManager(num_pages=32, page_size=PS)
    t = toks(0, 9)  # two full pages and one token

    def admit(salt, arrival):
        s = make_seq(t, arrival)
        s.cache_salt = salt
        got = bm.allocate_prefix(s, drop_last_hit=False)
        run_prefill(bm, s)
        return s, got

    plain, got = admit(None, 0)
    assert got == 0
    salted, got = admit("tenant-a", 1)
    assert got == 0 and not set(salted.pages) & set(plain.pages)
    again, got = admit("tenant-a", 2)
    assert got == 2 * PS and again.pages[:2] == salted.pages[:2]
    other, got = admit("tenant-b", 3)
    assert got == 0
    unsalted, got = admit(None, 4)
    assert got == 2 * PS and unsalted.pages[:2] == plain.pages[:2]


# ---- accounting and allocation ----------------------------------------------------------


def test_pages_needed_rounds_up_and_counts_existing_pages():
    bm = BlockManager(num_pages=8, page_size=PS)
    s = make_seq(toks(0, 5))
    assert [bm.pages_needed(s, n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    assert bm.ensure_slots(s, 5)
    assert len(s.pages) == 2
    assert [bm.pages_needed(s, n) for n in (1, 8, 9, 13)] == [0, 0, 1, 2]


def test_allocation_hands_out_lowest_page_ids_first_with_ref_one():
    bm = BlockManager(num_pages=6, page_size=PS)
    a, b = make_seq(toks(0, 9), 0), make_seq(toks(100, 5), 1)
    assert bm.ensure_slots(a, 9)
    assert a.pages == [0, 1, 2]
    assert bm.ensure_slots(b, 5)
    assert b.pages == [3, 4]
    assert bm.ref == [1, 1, 1, 1, 1, 0]
    assert bm.num_free_pages == 1
    # Growing an existing sequence appends pages; asking for what it has is a no-op.
    assert bm.ensure_slots(a, 12) and a.pages == [0, 1, 2]
    assert bm.ensure_slots(a, 13) and a.pages == [0, 1, 2, 5]
    assert bm.num_free_pages == 0


def test_ensure_slots_short_returns_false_and_changes_nothing():
    bm = BlockManager(num_pages=4, page_size=PS)
    a = make_seq(toks(0, 8))
    assert bm.ensure_slots(a, 8) and a.pages == [0, 1]
    ref_before = list(bm.ref)
    assert not bm.ensure_slots(a, 8 + 2 * PS + 1)  # needs 3 more, 2 free
    assert a.pages == [0, 1]
    assert bm.ref == ref_before
    assert bm.num_free_pages == 2
    assert bm.ensure_slots(a, 8 + 2 * PS)  # exactly the pool: fits
    assert a.pages == [0, 1, 2, 3] and bm.num_free_pages == 0


def test_free_returns_unhashed_pages_for_reuse_in_documented_order():
    bm = BlockManager(num_pages=5, page_size=PS)
    a = make_seq(toks(0, 12))
    assert bm.ensure_slots(a, 12) and a.pages == [0, 1, 2]
    bm.free(a)
    assert a.pages == [] and a.block_hashes == []
    assert bm.ref == [0] * 5
    assert bm.num_free_pages == 5
    assert not bm._evictable  # never hashed: straight back to the free stack
    b = make_seq(toks(50, 16))
    assert bm.ensure_slots(b, 16)
    assert b.pages == [0, 1, 2, 3]  # freed pages first (head first), then the untouched 3
    c = make_seq(toks(80, 1))
    assert bm.ensure_slots(c, 1) and c.pages == [4]


def test_free_is_idempotent_per_sequence_and_double_free_of_a_page_asserts():
    bm = BlockManager(num_pages=3, page_size=PS)
    a = make_seq(toks(0, 4))
    assert bm.ensure_slots(a, 4)
    bm.free(a)
    bm.free(a)  # the sequence no longer owns pages: nothing happens
    assert bm.ref == [0, 0, 0] and bm.num_free_pages == 3
    ghost = make_seq(toks(0, 4))
    ghost.pages = [0]  # a page nobody holds
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(ghost)


# ---- hashing: full committed pages only -------------------------------------------------


def test_commit_hashes_only_full_pages_of_final_tokens_chained_on_parent():
    bm = BlockManager(num_pages=8, page_size=PS)
    t = toks(10, 10)  # pages [10..13] [14..17] [18 19 | partial]
    a = make_seq(t)
    assert bm.ensure_slots(a, 10)
    bm.commit(a, num_final=7)  # only the first page is all final
    h0 = BlockManager.chain_hash(None, t[0:4])
    assert a.block_hashes == [h0]
    assert bm.page_hash == {a.pages[0]: h0} and bm.hash_page == {h0: a.pages[0]}
    bm.commit(a, num_final=10)  # second page now final; the third is not full
    h1 = BlockManager.chain_hash(h0, t[4:8])
    assert a.block_hashes == [h0, h1]
    assert bm.page_hash == {a.pages[0]: h0, a.pages[1]: h1}
    assert a.pages[2] not in bm.page_hash
    # The chain: the same page content after a different parent hashes differently.
    assert BlockManager.chain_hash(BlockManager.chain_hash(None, toks(99, 4)), t[4:8]) != h1


def test_commit_is_a_no_op_without_prefix_caching():
    bm = BlockManager(num_pages=4, page_size=PS, enable_prefix_caching=False)
    a = make_seq(toks(0, 9))
    run_prefill(bm, a)
    assert a.block_hashes == [] and bm.page_hash == {} and bm.hash_page == {}
    b = make_seq(toks(0, 9))
    assert bm.allocate_prefix(b, drop_last_hit=False) == 0
    assert b.pages == [] and bm.queries == 0 and bm.hits == 0
    bm.free(a)
    assert not bm._evictable and bm.num_free_pages == 4


def test_hash_next_token_needs_and_covers_the_token_after_the_page():
    bm = BlockManager(num_pages=8, page_size=PS, hash_next_token=True)
    t = toks(10, 8)  # two full pages, but no token after the second one yet
    a = make_seq(t)
    assert bm.ensure_slots(a, 8)
    bm.commit(a, num_final=8)
    h0 = BlockManager.chain_hash(None, t[0:5])  # page 0 plus token 4
    assert a.block_hashes == [h0]
    assert a.pages[1] not in bm.page_hash
    a.output_token_ids.append(77)  # the next token arrives (still only 8 final)
    bm.commit(a, num_final=8)
    assert a.block_hashes == [h0, BlockManager.chain_hash(h0, t[4:8] + [77])]


def test_duplicate_content_keeps_the_first_page_registered():
    """Two sequences computing the same prompt at once: the hash maps to the first page to
    commit; the other's page stays unregistered and goes back to the plain free stack."""
    bm = BlockManager(num_pages=6, page_size=PS)
    t = toks(0, 9)
    a, b = make_seq(t, 0), make_seq(t, 1)
    assert bm.ensure_slots(a, 9) and bm.ensure_slots(b, 9)
    a.num_computed = b.num_computed = 9
    bm.commit(a, 9)
    bm.commit(b, 9)
    assert b.block_hashes == a.block_hashes  # b knows its hashes (for its own chain)
    assert set(bm.page_hash) == set(a.pages[:2])
    assert not set(b.pages) & set(bm.page_hash)
    bm.free(b)
    assert not bm._evictable  # b's pages were not cached ones
    assert bm.num_free_pages == 3


# ---- prefix hits --------------------------------------------------------------------------


def test_prefix_hit_attaches_cached_pages_and_counts():
    bm = BlockManager(num_pages=8, page_size=PS)
    t = toks(0, 10)
    a = make_seq(t, 0)
    run_prefill(bm, a)
    assert a.pages == [0, 1, 2]
    bm.free(a)
    assert list(bm._evictable) == [1, 0]  # hashed pages stay cached; the tail (2) was never hashed
    free_before = bm.num_free_pages
    b = make_seq(t + [55, 56], 1)  # same first 10 tokens: 2 full cached pages
    assert bm.allocate_prefix(b, drop_last_hit=False) == 8
    assert b.num_computed == 8
    assert b.pages == [0, 1]
    assert b.block_hashes == chain_hashes(t, 2)
    assert bm.ref[0] == bm.ref[1] == 1
    assert not bm._evictable
    assert bm.num_free_pages == free_before - 2
    assert (bm.hits, bm.queries) == (2, (12 - 1) // PS)  # queried pages: full pages of all but the last token


def test_prefix_hit_always_leaves_one_token_to_compute():
    bm = BlockManager(num_pages=8, page_size=PS)
    t = toks(0, 8)  # exactly two full pages
    a = make_seq(t, 0)
    run_prefill(bm, a)
    assert len(a.block_hashes) == 2
    bm.free(a)
    b = make_seq(t, 1)
    assert bm.allocate_prefix(b, drop_last_hit=False) == 4  # not 8: the last page is recomputed
    assert b.pages == [0]
    assert (bm.hits, bm.queries) == (1, 1)


def test_drop_last_hit_recomputes_the_last_matched_page():
    bm = BlockManager(num_pages=8, page_size=PS)
    t = toks(0, 13)
    a = make_seq(t, 0)
    run_prefill(bm, a)
    bm.free(a)
    b = make_seq(t, 1)
    assert bm.allocate_prefix(b, drop_last_hit=True) == 8  # 3 matched, the last dropped
    assert b.pages == [0, 1]
    assert 2 in bm._evictable  # the dropped page is not taken
    assert (bm.hits, bm.queries) == (2, 3)
    c = make_seq(t, 2)
    bm.free(b)
    assert bm.allocate_prefix(c, drop_last_hit=False) == 12
    assert (bm.hits, bm.queries) == (5, 6)


def test_prefix_match_stops_at_first_differing_page():
    bm = BlockManager(num_pages=10, page_size=PS)
    t = toks(0, 13)
    a = make_seq(t, 0)
    run_prefill(bm, a)
    # Differs in the second page: only the first page is shared.
    b = make_seq(t[:5] + [999] + t[6:], 1)
    assert bm.allocate_prefix(b, drop_last_hit=False) == 4
    assert b.pages == [a.pages[0]]
    # Differs in the first page only: the chain breaks there, later equal pages do not hit.
    c = make_seq([999] + t[1:], 2)
    assert bm.allocate_prefix(c, drop_last_hit=False) == 0
    assert c.pages == []
    assert (bm.hits, bm.queries) == (1, 6)


def test_hash_next_token_hit_depends_on_the_token_after_the_page():
    t = toks(0, 13)
    b_tokens = t[:8] + [999, 1000]  # same first two pages, different token 8
    hits = {}
    for flag in (False, True):
        bm = BlockManager(num_pages=10, page_size=PS, hash_next_token=flag)
        a = make_seq(t, 0)
        run_prefill(bm, a)
        b = make_seq(b_tokens, 1)
        hits[flag] = bm.allocate_prefix(b, drop_last_hit=False)
    assert hits == {False: 8, True: 4}  # page 1's drafter KV was built from token 8


def test_shared_prefix_page_is_not_freed_while_referenced():
    bm = BlockManager(num_pages=6, page_size=PS)
    t = toks(0, 9)
    a = make_seq(t, 0)
    run_prefill(bm, a)  # pages 0, 1 (hashed), 2
    b = make_seq(t[:4] + toks(500, 5), 1)  # shares page 0 only
    assert bm.allocate_prefix(b, drop_last_hit=False) == 4
    assert b.pages == [0] and bm.ref[0] == 2
    assert bm.ensure_slots(b, 9) and b.pages == [0, 3, 4]
    bm.free(a)
    assert bm.ref[0] == 1  # still held by b
    assert 0 not in bm._free and 0 not in bm._evictable
    assert bm.num_free_pages == 3  # a's pages 1 (cached) and 2 (plain), and page 5
    # Exhaust the pool: page 0 is never handed out while b holds it.
    c = make_seq(toks(900, 12), 2)
    assert bm.ensure_slots(c, 12)
    assert sorted(c.pages) == [1, 2, 5] and 0 not in c.pages
    assert bm.ensure_slots(make_seq(toks(0, 1), 3), 1) is False
    bm.free(b)
    assert bm.ref[0] == 0 and list(bm._evictable) == [0]  # b's other pages were never hashed


# ---- LRU reuse of freed cached pages -----------------------------------------------------


def test_allocation_prefers_never_hashed_pages_then_evicts_least_recently_freed():
    bm = BlockManager(num_pages=6, page_size=PS)
    ta, tb = toks(0, 9), toks(100, 9)
    a, b = make_seq(ta, 0), make_seq(tb, 1)
    run_prefill(bm, a)  # pages 0, 1 hashed, 2 not
    run_prefill(bm, b)  # pages 3, 4 hashed, 5 not
    assert (a.pages, b.pages) == ([0, 1, 2], [3, 4, 5])
    bm.free(a)
    bm.free(b)
    # LRU order of cached pages: a's before b's, each sequence's tail before its head.
    assert list(bm._evictable) == [1, 0, 4, 3]
    assert bm.num_free_pages == 6
    c = make_seq(toks(200, 12), 2)
    assert bm.ensure_slots(c, 12)
    assert c.pages == [5, 2, 1]  # the plain free pages first, then the LRU cached page
    assert 1 not in bm.page_hash  # evicted: its hash is gone
    assert list(bm._evictable) == [0, 4, 3]
    # a's prefix now only hits its first page; b's is intact.
    a2 = make_seq(ta, 3)
    assert bm.allocate_prefix(a2, drop_last_hit=False) == 4 and a2.pages == [0]
    b2 = make_seq(tb, 4)
    assert bm.allocate_prefix(b2, drop_last_hit=False) == 8 and b2.pages == [3, 4]
    assert bm.num_free_pages == 0 and not bm._evictable


def test_revived_page_moves_to_the_back_of_the_lru_order():
    bm = BlockManager(num_pages=4, page_size=PS)
    ta, tb = toks(0, 5), toks(100, 5)
    a, b = make_seq(ta, 0), make_seq(tb, 1)
    run_prefill(bm, a)  # 0 hashed, 1 plain
    run_prefill(bm, b)  # 2 hashed, 3 plain
    bm.free(a)
    bm.free(b)
    assert list(bm._evictable) == [0, 2]
    a2 = make_seq(ta, 2)
    assert bm.allocate_prefix(a2, drop_last_hit=False) == 4 and a2.pages == [0]
    bm.free(a2)  # page 0 freed again: now the most recently freed
    assert list(bm._evictable) == [2, 0]
    c = make_seq(toks(300, 12), 3)
    assert bm.ensure_slots(c, 12)
    assert c.pages == [3, 1, 2]  # plain pages (stack order), then the LRU cached page 2
    assert 0 in bm.page_hash and 2 not in bm.page_hash
