"""Issue 57 must-show: adding a speculative method is one module plus one registry line.

This file is the module: "repeat", a method whose drafts are K copies of the bonus token
(the token the step has just emitted), with no weights and no cache. The line is the
``monkeypatch.setitem(REGISTRY, ...)`` below, scoped to the test. Through ``jspec.LLM`` on
the family's target its greedy output equals plain greedy decoding, and its acceptance
counters are exactly what its drafts predict from that output: each step, the run of
following tokens equal to the bonus token, up to K. So the drafts were the method's and
went through verification.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import jspec
from jspec.drafters.config import DrafterConfig, layerless_config
from jspec.drafters.method import Method
from jspec.drafters.propose import ProposeInputs, gather_rows
from jspec.drafters.registry import REGISTRY
from jspec.speculative_config import SpeculativeConfig

K = 3
MAX_TOKENS = 24
# The family's target continues the tabs with a run of one token ("ssss..."), the others
# with few repeats: drafts accepted and rejected.
PROMPTS = ["\t\t\t\t\t\t", "x = '" + "a" * 30, "def f(x):\n    return x\n\n\n"]
ENGINE = dict(max_model_len=128, max_num_seqs=4, enable_prefix_caching=False)


# ---- the method's module ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RepeatDrafter:
    """The method's "module": its config, static under jit."""

    cfg: DrafterConfig
    dtype: Any = dataclasses.field(default=None, compare=False)  # make_drafter's keywords: unused
    plan: Any = dataclasses.field(default=None, compare=False)


def repeat_propose(drafter: RepeatDrafter, params, cache, inp: ProposeInputs, *, num_tokens: int,
                   with_probs: bool = False):
    """(drafts i32[N, K]: the bonus token K times, one-hot probs f32[N, K, V] | None, cache)."""
    del params
    bonus = gather_rows(inp.tokens, inp.last_idx)  # i32[N] the last pair's token
    drafts = jnp.repeat(bonus[:, None], num_tokens, axis=1)
    probs = jax.nn.one_hot(drafts, drafter.cfg.target_vocab_size, dtype=jnp.float32) if with_probs else None
    return drafts, probs, cache


def load(spec, target, dtype, sharding, load_format):
    del spec, dtype, sharding, load_format  # no weights
    return layerless_config("repeat", target), {}


METHOD = Method(
    label="repeat", module=RepeatDrafter, propose=repeat_propose, lookahead=lambda cfg, k: 0, reads_next_token=False,
    load=load, create_cache=lambda cfg, num_pages, page_size, dtype, sharding=None: None, needs_model=False,
)


# ---- the test --------------------------------------------------------------------------
def predicted(tokens: list[int], k: int, max_tokens: int) -> tuple[int, int]:
    """(verification steps, accepted drafts) of one request whose greedy output begins with
    ``tokens`` (at least max_tokens + k of them), the drafts K copies of the last token."""
    i, steps, accepted = 0, 0, 0  # i: index of the last emitted token (the bonus)
    while i + 1 < max_tokens:
        a = 0
        while a < k and tokens[i + 1 + a] == tokens[i]:
            a += 1
        steps, accepted, i = steps + 1, accepted + a, i + a + 1
    return steps, accepted


def test_a_method_is_one_module_and_one_registry_line(monkeypatch):
    with pytest.raises(ValueError, match="'method' must be one of .* got 'repeat'"):
        SpeculativeConfig(method="repeat")  # not a method before its line
    plain = jspec.LLM(**ENGINE)
    ref = plain.generate(PROMPTS, jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS + K, ignore_eos=True))
    del plain

    monkeypatch.setitem(REGISTRY, "repeat", METHOD)  # the one registry line

    llm = jspec.LLM(speculative_config={"method": "repeat", "num_speculative_tokens": K}, **ENGINE)
    assert (llm.engine.K, llm.engine.lookahead) == (K, 0)
    outs = llm.generate(PROMPTS, jspec.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    drafted = accepted = 0
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids[:MAX_TOKENS]
        want_steps, want_accepted = predicted(r.token_ids, K, MAX_TOKENS)
        m = o.metrics
        assert (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens) == (want_steps, K * want_steps, want_accepted)
        drafted, accepted = drafted + m.num_draft_tokens, accepted + m.num_accepted_tokens
    assert 0 < accepted < drafted  # drafts both accepted and rejected
