"""Async scheduling with speculation: a verification step dispatched from the bonus token
and drafts of the step before it, while that one is still on the device.

The chained step runs past sequences that stop or are aborted inside the step before it,
and writes target and drafter KV into pages freed while it is queued. Outputs must equal
the synchronous engine's token for token: greedy, seeded sampling, and drafts sampled with
their probabilities (the draft-probability buffer carried on the device between steps).
"""

from __future__ import annotations

import pytest

import jspec
from tests.helpers import spec_e2e as h
from tests.helpers.engine import drive

CASES = [("eagle3", 3, {"draft_sample_method": "probabilistic"}), ("peagle", 3, {}), ("dflash4", 3, {}),
         ("ngram", 3, {}), ("draft_llama", 3, {"draft_sample_method": "probabilistic"})]
KW = dict(max_num_seqs=2, max_model_len=56, num_pages=12)


@pytest.mark.parametrize("name,k,extra", CASES, ids=[c[0] for c in CASES])
def test_async_spec_matches_sync(name, k, extra):
    p0, p1, p2, p3 = h.varied_prompts(4, 3, 20, seed=21)
    greedy = dict(temperature=0.0, ignore_eos=True)
    ref0 = h.greedy_reference([p0], 30)[0]
    # r0 stops at its 9th token (a stop token id), inside a step while the next is queued.
    stop = jspec.SamplingParams(max_tokens=30, stop_token_ids=[ref0[8]], **greedy)
    cut = ref0.index(ref0[8]) + 1
    sampled = jspec.SamplingParams(temperature=0.9, max_tokens=26, seed=5, ignore_eos=True)
    script = {
        0: [("add", "r0", p0, stop), ("add", "r1", p1, sampled)],
        5: [("add", "r2", p2, jspec.SamplingParams(max_tokens=21, **greedy))],
        # r3 is aborted mid-decode, while a step chained for it may still be queued.
        8: [("add", "r3", p3, jspec.SamplingParams(max_tokens=30, **greedy)), ("abort", "r3", 4)],
    }
    outs = {}
    for mode in (False, True):
        llm = h.llm(name, k, spec_extra=extra, async_scheduling=mode, **KW)
        chained = llm.engine.num_chained_calls
        outs[mode] = drive(llm, script)
        assert (llm.engine.num_chained_calls > chained) == mode
        assert llm.engine.num_free_pages == llm.engine.num_pages
    for rid in ("r0", "r1", "r2"):
        assert outs[True][rid] == outs[False][rid], rid
    assert outs[True]["r0"] == (ref0[:cut], "stop")
    assert outs[True]["r2"][0] == h.greedy_reference([p2], 21)[0]
    assert len(outs[True]["r1"][0]) == 26
    r3 = outs[True]["r3"][0]
    assert len(r3) >= 4 and r3 == h.greedy_reference([p3], 30)[0][: len(r3)]


@pytest.mark.parametrize("limit_by", ["drafter config", "speculative_config"])
def test_no_draft_past_the_drafters_positions(tmp_path, limit_by):
    """A drafter trained on 24 positions, or held to 24 by speculative_config's max_model_len
    (vLLM's draft max_model_len), proposes no draft at position 24 or later (vLLM guards
    this too); the output stays the target's greedy output."""
    import json
    import shutil

    folder = h.drafter("eagle3")
    spec = {"method": "eagle3", "num_speculative_tokens": 3}
    if limit_by == "drafter config":
        folder = str(tmp_path / "eagle3_short")
        shutil.copytree(h.drafter("eagle3"), folder)
        cfg = json.load(open(f"{folder}/config.json"))
        cfg["transformer_layer_config"]["max_position_embeddings"] = 24
        json.dump(cfg, open(f"{folder}/config.json", "w"))
    else:
        spec["max_model_len"] = 24
    folder_t, _ = h.target()
    llm = jspec.LLM(folder_t, speculative_config={**spec, "model": folder}, **{**h.ENGINE_KW, "num_pages": 12})
    eng = llm.engine
    assert eng.draft_max_len == 24
    prompt = h.varied_prompts(1, 5, 5, seed=4)[0]
    eng.add_request("r", prompt, jspec.SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    drafted_late = False
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                assert o.token_ids == h.greedy_reference([prompt], 40)[0]
        for s in eng.scheduler.running:
            # draft j of a sequence of n tokens sits at position n - 1 + j
            assert not s.draft_token_ids or s.num_tokens + len(s.draft_token_ids) <= 24, (s.num_tokens,
                                                                                          s.draft_token_ids)
            drafted_late |= s.num_tokens >= 21 and len(s.draft_token_ids) > 0
    assert drafted_late  # drafting ran up to the limit, then stopped
