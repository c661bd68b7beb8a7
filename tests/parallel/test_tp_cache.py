"""Issue 29 must-show: prefix caching and preemption stay exact under tensor parallelism.

A plain engine at tp 4 (KV heads replicated) with 8-token pages and a pool too small for
its two sequences (preemption by recompute must happen), on prompts sharing a 16-token
prefix, run twice so the second call starts from cached pages: its greedy outputs equal the
engine's at tp 1 (one page holding each sequence: no preemption, no shared pages).
The speculative engines' caches under tp are exercised by test_tp_greedy.py; a speculative
engine under this pool compiles eight step shapes (~1.5 min of the CPU here), too many for
the folder's time budget.
"""

from __future__ import annotations

from tests.helpers import parallel as h

SHARED = h.prompts(1, 16, 16, seed=5)[0]
A, B, C = (SHARED + p for p in h.prompts(3, 4, 10, seed=6))
N = 16


def test_prefix_cache_and_preemption_exact_at_tp4():
    want = dict(zip("ABC", h.generate(h.llm("llama", None, 1), [A, B, C], N)))
    llm = h.llm("llama", None, 4, page_size=8, num_pages=8)
    eng = llm.engine
    hits0, pre0 = eng.blocks.hits, eng.scheduler.num_preemptions
    assert h.generate(llm, [A, B], N) == [want["A"], want["B"]]
    assert h.generate(llm, [A, C], N) == [want["A"], want["C"]]
    assert eng.scheduler.num_preemptions > pre0, "the pool was meant to force a preemption"
    assert eng.blocks.hits > hits0, "the second call was meant to hit the prefix cache"
