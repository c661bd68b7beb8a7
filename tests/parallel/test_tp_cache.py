"""Issue 29 must-show: prefix caching and preemption stay exact under tensor parallelism.

A plain engine at tp 4 (KV heads replicated) and a PEagle engine at tp 2 (target and
drafter caches sharded by KV head; EAGLE-style page hashes), both with async scheduling,
8-token pages and a pool too small for their two sequences (preemption by recompute must
happen), on prompts sharing a 16-token prefix (two pages), run twice so the second call
starts from cached pages: their greedy outputs equal the plain engine's at tp 1 (one page
holding each sequence: no preemption, no shared pages).
"""

from __future__ import annotations

import pytest

from tests.helpers import parallel as h

SHARED = h.prompts(1, 16, 16, seed=5)[0]
# (drafter, tp, engine arguments, the distinct tails' lengths, tokens generated). The plain
# engine: max_model_len 29 keeps one page-table bucket (4 pages of 8), fewer compiled shapes;
# five pages admit both prompts (3 pages, 2 of them shared once the first is cached) but not
# their growth (4 each). PEagle: its lookahead and EAGLE-style hashes (the last hit page is
# recomputed) need a longer run to preempt.
CASES = [(None, 4, dict(page_size=8, num_pages=5, max_model_len=29), (2, 4), 8),
         ("peagle", 2, dict(page_size=8, num_pages=8), (4, 10), 16)]


@pytest.mark.parametrize("name,tp,stress,tails,n", CASES, ids=["plain-tp4", "peagle-tp2"])
def test_prefix_cache_and_preemption_exact(name, tp, stress, tails, n):
    A, B, C = (SHARED + p for p in h.prompts(3, *tails, seed=6))
    want = dict(zip("ABC", h.generate(h.llm("llama", None, 1), [A, B, C], n)))
    llm = h.llm("llama", name, tp, async_scheduling=True, **stress)
    eng = llm.engine
    hits0, pre0 = eng.blocks.hits, eng.scheduler.num_preemptions
    assert h.generate(llm, [A, B], n) == [want["A"], want["B"]]
    assert h.generate(llm, [A, C], n) == [want["A"], want["C"]]
    assert eng.scheduler.num_preemptions > pre0, "the pool was meant to force a preemption"
    assert eng.blocks.hits > hits0, "the second call was meant to hit the prefix cache"
    assert eng.num_chained_calls > 0  # async scheduling: calls dispatched behind unread ones
