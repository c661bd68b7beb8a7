"""Issue 29 must-show: prefix caching and preemption stay exact under tensor parallelism.

A plain engine at tp 4 (KV heads replicated) and a PEagle engine at tp 2 (target and
drafter caches sharded by KV head; EAGLE-style page hashes), both with async scheduling,
8-token pages and a pool too small for their two sequences (preemption by recompute must
happen), on prompts sharing a 16-token prefix, run twice so the second call starts from
cached pages: their greedy outputs equal the plain engine's at tp 1 (one page holding each
sequence: no preemption, no shared pages).
"""

from __future__ import annotations

import pytest

from tests.helpers import parallel as h

SHARED = h.prompts(1, 16, 16, seed=5)[0]
A, B, C = (SHARED + p for p in h.prompts(3, 4, 10, seed=6))
N = 16


@pytest.mark.parametrize("name,tp", [(None, 4), ("peagle", 2)])
def test_prefix_cache_and_preemption_exact(name, tp):
    want = dict(zip("ABC", h.generate(h.llm("llama", None, 1), [A, B, C], N)))
    llm = h.llm("llama", name, tp, page_size=8, num_pages=8, async_scheduling=True)
    eng = llm.engine
    hits0, pre0 = eng.blocks.hits, eng.scheduler.num_preemptions
    assert h.generate(llm, [A, B], N) == [want["A"], want["B"]]
    assert h.generate(llm, [A, C], N) == [want["A"], want["C"]]
    assert eng.scheduler.num_preemptions > pre0, "the pool was meant to force a preemption"
    assert eng.blocks.hits > hits0, "the second call was meant to hit the prefix cache"
    assert eng.num_chained_calls > 0  # async scheduling: calls dispatched behind unread ones
