"""Structured outputs (issue 27) end to end on the shipped family (real tokenizer, real
drafters): 50 JSON schemas of varied shape in one batch, at T=0 and T=1, plain and with each
drafter; every finished output parses and validates (``jsonschema``), nearly all finish, and
greedy structured speculation equals greedy structured plain decoding. Controls that the
checks can fail: the same prompts without the grammar do not validate, and a mask applied
at the first verification position only breaks the speculative outputs."""

from __future__ import annotations

import numpy as np
import pytest

import jspec
from jspec import family
from jspec.engine import sampling_step
from tests.helpers.structured import schemas, valid

SCHEMAS = schemas(50)
PROMPTS = [f"# config {i}\nsettings = " for i in range(len(SCHEMAS))]
ENGINE = dict(dtype="float32", max_num_seqs=8, max_model_len=256, max_prefill_chunk=64, page_size=64)
MAX_TOKENS = 120


def params(T: float, seed: int = 0) -> list[jspec.SamplingParams]:
    return [jspec.SamplingParams(temperature=T, seed=seed + i, max_tokens=MAX_TOKENS,
                                 structured_outputs=jspec.StructuredOutputsParams(json=s, disable_any_whitespace=True))
            for i, s in enumerate(SCHEMAS)]


def check(outs) -> list[str]:
    """Texts of the outputs; asserts every finished one validates and nearly all finished."""
    finished = [(o.outputs[0], s) for o, s in zip(outs, SCHEMAS) if o.outputs[0].finish_reason == "stop"]
    assert len(finished) >= 0.95 * len(outs), [o.outputs[0].finish_reason for o in outs]
    bad = [c.text for c, s in finished if not valid(c.text, s)]
    assert not bad, bad[:3]
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def plain():
    llm = jspec.LLM(**ENGINE)
    return llm, {T: check(llm.generate(PROMPTS, params(T))) for T in (0.0, 1.0)}


def test_plain_outputs_validate_and_the_check_can_fail(plain):
    llm, texts = plain
    assert texts[0.0] != texts[1.0]
    # Without the mask the same model writes Python, not these objects.
    raw = llm.generate(PROMPTS[:16], jspec.SamplingParams(temperature=0, max_tokens=48))
    assert sum(valid(o.outputs[0].text, s) for o, s in zip(raw, SCHEMAS)) == 0


@pytest.mark.parametrize("method", family.METHODS)
def test_speculative_outputs_validate_and_greedy_equals_plain(plain, method, monkeypatch):
    llm = jspec.LLM(speculative_config={"method": method}, **ENGINE)
    greedy = check(llm.generate(PROMPTS, params(0.0)))
    assert greedy == plain[1][0.0]
    stats = llm.engine.stats()
    assert stats["accepted_per_position"][1] > 0  # drafts verified (and accepted) past the first position
    assert stats["num_chained_calls"] > 0  # masked batches chain (split steps)
    sampled = check(llm.generate(PROMPTS, params(1.0, seed=100)))
    if method != "eagle3":
        return
    # The split steps give the unchained path's tokens (seeded T=1; greedy is compared above).
    with monkeypatch.context() as m:
        m.setattr(llm.engine, "_chain", lambda f: None)
        assert [o.outputs[0].text for o in llm.generate(PROMPTS[:8], params(1.0, seed=100)[:8])] == sampled[:8]
    # The control: masks at the first verification position only (later ones allow every
    # token), same compiled shapes: the checks above catch it.
    build = sampling_step.build_bitmask

    def first_position_only(rows, B, Q, V, chained=False):
        m = build(rows, B, Q, V, chained)
        if m is not None:
            m[:, 1:] = -1
        return m

    monkeypatch.setattr(sampling_step, "build_bitmask", first_position_only)
    outs = llm.generate(PROMPTS, params(0.0))
    broken = [o.outputs[0].finish_reason != "stop" or not valid(o.outputs[0].text, s) for o, s in zip(outs, SCHEMAS)]
    assert np.mean(broken) > 0.2 or [o.outputs[0].text for o in outs] != greedy
