"""Host-side page allocator with ref-counted prefix caching (plain Python).

A page holds ``page_size`` consecutive tokens of one sequence. A *full* page of committed
tokens gets a hash chained on its parent's: sha256 over the parent page's hash and the
page's tokens (``chain_hash``); identical prefixes then share pages. A hit is taken on the
hash alone, so the hash must not collide even for prompts built to make it collide (a
server's client could otherwise be handed another's KV): Python's 64-bit ``hash`` of a
tuple is not such a hash, sha256 is (vLLM's default). A request's ``cache_salt`` goes into
its first page's parent, so only requests with the same salt share pages (vLLM's
``cache_salt``).

Shared or hashed pages are never written again: a sequence only writes at
positions >= its ``num_computed``, and hits are capped so that at least one token (and, for
EAGLE-style drafters, the whole last matched page) is recomputed into a page of its own.

Free pages: ``_free`` (never hashed, or evicted) and ``_evictable`` (ref count 0 but still
hashed, in LRU order: a later request may revive them). Allocation takes ``_free`` first
and evicts the least recently freed cached page only when it must.

Drafts are never hashed: only committed tokens below the caller's ``num_final`` count.
EAGLE-style drafters keep, at position p, KV computed from token p + 1: the last slot of a
page depends on the first token of the next page. With ``hash_next_token`` a page's hash
covers that token too, so a hit never hands out drafter KV built for another continuation.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from jspec.engine.sequence import Sequence

# The parent of an unsalted first page.
_ROOT = hashlib.sha256(b"jspec prefix cache").digest()


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 hash_next_token: bool = False):
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra = 1 if hash_next_token else 0  # tokens past the page that its hash covers
        self.ref = [0] * num_pages
        self.page_hash: dict[int, bytes] = {}  # page -> hash (registered full pages)
        self.hash_page: dict[bytes, int] = {}  # hash -> page
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # stack, page 0 handed out first
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # full prompt pages looked up, cumulative
        # in tokens, as vLLM counts its prefix-cache metrics: the lookups' prompt tokens, and
        # the tokens their hits served (whole pages: ``hits`` counts them)
        self.query_tokens = 0
        self.hit_tokens = 0

    # ---- accounting -------------------------------------------------------------------
    @property
    def hits(self) -> int:
        """Pages served from the cache (prefix hits), cumulative."""
        return self.hit_tokens // self.page_size

    @property
    def num_free_pages(self) -> int:
        return len(self._free) + len(self._evictable)

    def pages_needed(self, seq: Sequence, num_slots: int) -> int:
        """Extra pages for ``seq`` to hold ``num_slots`` token slots."""
        return max(0, -(-num_slots // self.page_size) - len(seq.pages))

    # ---- hashing ----------------------------------------------------------------------
    @staticmethod
    def root_hash(salt: str | None) -> bytes | None:
        """The parent of a first page: None (the unsalted root) or the salt's own root."""
        return None if salt is None else hashlib.sha256(_ROOT + salt.encode()).digest()

    @staticmethod
    def chain_hash(parent: bytes | None, tokens) -> bytes:
        # Fixed widths (32-byte parent, 8 bytes a token) make the encoding unambiguous.
        return hashlib.sha256((_ROOT if parent is None else parent) + array("q", tokens).tobytes()).digest()

    def _prompt_hashes(self, tokens: list[int], limit_pages: int, salt: str | None = None) -> list[bytes]:
        hashes, parent = [], self.root_hash(salt)
        ps = self.page_size
        for i in range(limit_pages):
            parent = self.chain_hash(parent, tokens[i * ps : (i + 1) * ps + self.extra])
            hashes.append(parent)
        return hashes

    # ---- allocation -------------------------------------------------------------------
    def _take(self) -> int:
        if self._free:
            page = self._free.pop()
        else:
            page, _ = self._evictable.popitem(last=False)  # least recently freed
            del self.hash_page[self.page_hash.pop(page)]
        self.ref[page] = 1
        return page

    def allocate_prefix(self, seq: Sequence, drop_last_hit: bool) -> int:
        """Attach cached pages for the longest hashed prefix of ``seq``'s tokens.

        Returns the number of tokens covered (also stored in ``seq.num_computed``). At least
        one token is always left to compute, so the step that follows has logits to sample.
        """
        assert not seq.pages
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position computed (as vLLM)
        tokens = seq.token_ids
        full = (len(tokens) - 1) // self.page_size
        hashes = self._prompt_hashes(tokens, full, seq.cache_salt)
        self.queries += full
        self.query_tokens += len(tokens)
        hit = []
        for h in hashes:
            page = self.hash_page.get(h)
            if page is None:
                break
            hit.append((h, page))
        if drop_last_hit and hit:
            hit.pop()
        for h, page in hit:
            if self.ref[page] == 0:
                del self._evictable[page]
            self.ref[page] += 1
            seq.pages.append(page)
            seq.block_hashes.append(h)
        seq.num_computed = len(hit) * self.page_size
        self.hit_tokens += seq.num_computed
        return seq.num_computed

    def ensure_slots(self, seq: Sequence, num_slots: int) -> bool:
        """Grow ``seq.pages`` to hold ``num_slots`` slots; False (and no change) if short."""
        need = self.pages_needed(seq, num_slots)
        if need > self.num_free_pages:
            return False
        for _ in range(need):
            seq.pages.append(self._take())
        return True

    def commit(self, seq: Sequence, num_final: int):
        """Register newly full pages whose first ``num_final`` tokens are final."""
        if not self.enable_prefix_caching:
            return
        ps = self.page_size
        while (len(seq.block_hashes) + 1) * ps <= num_final and seq.num_tokens >= (len(seq.block_hashes) + 1) * ps + self.extra:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else self.root_hash(seq.cache_salt)
            h = self.chain_hash(parent, seq.tokens_between(i * ps, (i + 1) * ps + self.extra))
            seq.block_hashes.append(h)
            page = seq.pages[i]
            if h not in self.hash_page and page not in self.page_hash:
                self.hash_page[h] = page
                self.page_hash[page] = h

    def free(self, seq: Sequence):
        # Reverse order: a sequence's tail pages are evicted before its (more shareable) head.
        for page in reversed(seq.pages):
            self.ref[page] -= 1
            assert self.ref[page] >= 0, f"page {page} freed twice"
            if self.ref[page] == 0:
                if page in self.page_hash:
                    self._evictable[page] = None
                else:
                    self._free.append(page)
        seq.pages = []
        seq.block_hashes = []

    def forget_cached_pages(self):
        """Empty the prefix cache, every sequence's pages freed first (jspec/engine/recovery.py:
        the pages' contents are gone): cached pages return to the free list."""
        assert not any(self.ref), "forget_cached_pages with pages still held"
        self._free.extend(reversed(self._evictable))
        self._evictable.clear()
        self.page_hash.clear()
        self.hash_page.clear()
