"""Issue 5 must-show: greedy speculative decoding is lossless end to end.

For every drafter method and layout (EAGLE3 speculators + reduced vocab, EAGLE3 original
layout, PEagle, DFlash speculators and z-lab layouts, DFlash below its block) and K in {1, 3, 7}: a batch of varied
prompts (lengths 1..50) decoded greedily with speculation equals, token for token, greedy
decoding without speculation (and without prefix caching), under
  - a page pool too small for the running sequences (preemptions must happen), and
  - max_model_len = 56, so long prompts hit the window (the engine drafts fewer tokens there).
The drafters agree with the target through a planted feature (tests/helpers/spec_e2e.py docstring),
so acceptance lengths vary over 1..K+1; mean acceptance length > 1.3 is asserted so the
test cannot pass with every draft rejected.
"""

from __future__ import annotations

import pytest

import jspec
from tests.helpers import spec_e2e as h

MAX_TOKENS = 16
PROMPTS = h.varied_prompts(8, 1, 50, seed=0)
# DFlash with K below block_size - 1: the whole block runs, only K drafts are picked.
CASES = h.LOSSLESS_CASES + [("dflash8_zlab", 3)]


@pytest.mark.parametrize("name,k", CASES, ids=[f"{n}-K{k}" for n, k in CASES])
def test_greedy_lossless(name, k):
    want = h.greedy_reference(PROMPTS, MAX_TOKENS)
    llm = h.llm(name, k)
    eng = llm.engine
    assert eng.K == k
    before, pre0 = eng.stats(), eng.scheduler.num_preemptions
    outs = llm.generate(PROMPTS, jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    d = h.stats_delta(before, eng.stats())
    for p, o, w in zip(PROMPTS, outs, want):
        assert o.token_ids == w, f"prompt of length {len(p)}: speculative output differs"
    # The pool forced preemptions, and some sequences ran into max_model_len.
    assert eng.scheduler.num_preemptions > pre0
    assert any(len(p) + len(o.token_ids) == eng.max_model_len and len(o.token_ids) < MAX_TOKENS
               for p, o in zip(PROMPTS, outs))
    # Accept paths exercised: otherwise every step emits one token and the test is vacuous.
    assert d["mean_acceptance_length"] > 1.3, d
    if k > 1:
        assert d["accepted_per_position"][1] > 0, d
    print(f"{name} K={k}: mean acceptance length {d['mean_acceptance_length']:.3f}, "
          f"per position {[round(a / d['num_drafts'], 3) for a in d['accepted_per_position']]}, "
          f"preemptions {eng.scheduler.num_preemptions - pre0}")


def test_per_request_metrics_sum_to_engine_stats():
    llm = h.llm("eagle3", 7)
    eng = llm.engine
    before = eng.stats()
    outs = llm.generate(PROMPTS[:5], jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    d = h.stats_delta(before, eng.stats())
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert sum(getattr(o.metrics, key) for o in outs) == d[key], key
    per_pos = [sum(o.metrics.accepted_per_position[i] for o in outs if o.metrics.accepted_per_position)
               for i in range(7)]
    assert per_pos == d["accepted_per_position"]
    assert sum(per_pos) == d["num_accepted_tokens"]
    for o in outs:
        m = o.metrics
        assert m.num_draft_tokens <= 7 * m.num_drafts
        assert m.mean_acceptance_length == pytest.approx(1 + m.num_accepted_tokens / m.num_drafts)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert d["mean_acceptance_length"] > 1.3


def test_error_paths(tmp_path):
    folder, _ = h.target()
    with pytest.raises(ValueError, match="unknown speculative_config key 'num_spec_tokens'"):
        jspec.LLM(folder, speculative_config={"method": "eagle3", "model": h.drafter("eagle3"), "num_spec_tokens": 3})
    with pytest.raises(ValueError, match="checkpoint .* is a 'eagle3' drafter"):
        jspec.LLM(folder, speculative_config={"method": "dflash", "model": h.drafter("eagle3")})
    with pytest.raises(ValueError, match="checkpoint .* is a 'dflash' drafter"):
        jspec.LLM(folder, speculative_config={"method": "peagle", "model": h.drafter("dflash4")})
    with pytest.raises(FileNotFoundError, match="not a directory"):
        jspec.LLM(folder, speculative_config={"method": "eagle3", "model": str(tmp_path / "missing")})
    with pytest.raises(ValueError, match="model"):
        jspec.LLM(folder, speculative_config={"method": "eagle3"})
    with pytest.raises(ValueError, match="exceeds the DFlash block"):
        jspec.LLM(folder, speculative_config={"method": "dflash", "model": h.drafter("dflash4"), "num_speculative_tokens": 4})


def test_method_read_off_the_checkpoint_as_vllm_does():
    """speculative_config with a model and no method: the drafter layout's method, else
    "draft_model" (an ordinary LLM); "draft_model" without a model names what it needs."""
    folder, _ = h.target()
    for name, method in (("eagle3", "eagle3"), ("dflash4", "dflash"), ("draft_llama", "draft_model")):
        llm = jspec.LLM(folder, speculative_config={"model": h.drafter(name), "num_speculative_tokens": 2},
                        **h.ENGINE_KW)
        assert llm.engine.spec.method == method and llm.engine.dcfg.method == method
    with pytest.raises(ValueError, match="'num_speculative_tokens' is required: the checkpoint at .* does not give"):
        jspec.LLM(folder, speculative_config={"model": h.drafter("draft_llama")})
    with pytest.raises(ValueError, match="method 'draft_model' needs 'model'"):
        jspec.LLM(folder, speculative_config={"method": "draft_model", "num_speculative_tokens": 3})
