"""Structured outputs' parts (jspec/engine/structured.py): StructuredOutputsParams' checks, the
packed masks against llguidance's own (position by position through the drafts) and against
its numpy reference on logits, the grammar's advance over a step's tokens, and the engine on
the tiny default model: bad grammars refused without touching other requests, one compile
per grammar, multi-step and sync scheduling, unconstrained rows in a mixed batch unchanged."""

from __future__ import annotations

import os
import re
import shutil
import types

import jax.numpy as jnp
import llguidance.numpy as lnp
import numpy as np
import pytest

import jspec
from jspec.engine import structured
from jspec.engine.sequence import Sequence
from jspec.sampling_params import SamplingParamsError
from jspec.sampling_params import StructuredOutputsParams as SOP
from tests.helpers.default_model import default_model_path

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "b": {"enum": ["x", "yy"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.mark.parametrize("kw, needle", [
    ({}, "exactly one"), ({"json": SCHEMA, "regex": "a"}, "exactly one"),
    ({"json": {"type": "foo"}}, "Invalid type"), ({"json": "{not json"}, "not valid JSON"),
    ({"regex": "a(b"}, "unclosed group"), ({"grammar": "start: x"}, "unknown name"),
    ({"choice": []}, "non-empty list"), ({"choice": "ab"}, "non-empty list"), ({"regex": 3}, "string"),
    ({"json_object": True, "disable_any_whitespace": 1}, "bool"),
])
def test_bad_structured_outputs_name_the_field_and_the_error(kw, needle):
    with pytest.raises(SamplingParamsError) as e:
        SOP(**kw)
    assert e.value.param == "structured_outputs" and needle in str(e.value)
    with pytest.raises(SamplingParamsError, match="structured_outputs"):
        jspec.SamplingParams(structured_outputs=kw)
    with pytest.raises(SamplingParamsError, match="unknown field"):
        jspec.SamplingParams(structured_outputs={"jsn": SCHEMA})


def test_params_equal_by_grammar_and_hashable():
    a = SOP(json=SCHEMA)
    b = SOP(json=dict(reversed(list(SCHEMA.items()))))
    c = SOP(json=str(SCHEMA).replace("'", '"').replace("False", "false"))
    assert a == b == c and len({a, b, c}) == 1 and a != SOP(json=SCHEMA, disable_any_whitespace=True)
    sp = jspec.SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert sp.structured_outputs == SOP(choice=("yes", "no")) and hash(sp)


@pytest.fixture(scope="module")
def compiler():
    from transformers import AutoTokenizer

    return structured.GrammarCompiler(AutoTokenizer.from_pretrained(default_model_path()), 320, [257, 260])


def _row(compiler, so, drafts=(), sample=True, out=()):
    seq = Sequence("r", [1, 2], jspec.SamplingParams(structured_outputs=so), 0, 0)
    seq.grammar = compiler.matcher(seq.params)
    seq.grammar.consume_tokens(list(out))
    seq.draft_token_ids = list(drafts)
    return types.SimpleNamespace(seq=seq, sample=sample)


def _bits(mask_row, V=320):
    return np.array([(int(mask_row[v // 32]) >> (v % 32)) & 1 for v in range(V)], bool)


def test_masks_at_every_position_follow_the_drafts(compiler):
    enc = lambda s: list(s.encode())  # noqa: E731 (the tiny model's tokens are bytes)
    so = SOP(json=SCHEMA, disable_any_whitespace=True)
    rows = [_row(compiler, so, enc('{"a"')), types.SimpleNamespace(seq=Sequence("p", [1], jspec.SamplingParams(),
                                                                                      0, 0), sample=True),
            _row(compiler, SOP(regex="[a-c]+z"), enc("ab")), _row(compiler, so, sample=False)]
    Q = 5
    mask = structured.build_bitmask(rows, 4, Q, 320)
    assert mask.shape == (4, Q, 10) and mask.dtype == np.int32
    for b in (0, 2):
        seq = rows[b].seq
        ref = compiler.matcher(seq.params)
        want = np.full((Q, 10), -1, np.int32)
        for j in range(len(seq.draft_token_ids) + 1):
            lnp.fill_next_token_bitmask(ref, want, j)
            if j < len(seq.draft_token_ids):
                assert ref.consume_token(seq.draft_token_ids[j])
        np.testing.assert_array_equal(mask[b], want)
    assert (mask[1] == -1).all() and (mask[3] == -1).all()  # no grammar / not sampling: all allowed
    assert mask[2, 2, 0] != -1 and _bits(mask[2, 2])[ord("z")] and not _bits(mask[2, 2])[ord("{")]
    assert _bits(mask[0, 0]).sum() == 1 and _bits(mask[0, 0])[ord("{")]
    assert structured.build_bitmask(rows[1:2], 1, Q, 320) is None
    with pytest.raises(RuntimeError, match="chained"):
        structured.build_bitmask(rows, 4, Q, 320, chained=True)


@pytest.mark.parametrize("V", [37, 320, 1000])
def test_apply_bitmask_equals_llguidance_numpy(V):
    rng = np.random.default_rng(V)
    B, Q = 3, 2
    mask = rng.integers(-2**31, 2**31, (B, Q, (V + 31) // 32), dtype=np.int64).astype(np.int32)
    logits = rng.standard_normal((B, Q, V)).astype(np.float32)
    want = logits.reshape(B * Q, V).copy()
    lnp.apply_token_bitmask_inplace(want, mask.reshape(B * Q, -1))
    got = np.asarray(structured.apply_bitmask(jnp.asarray(logits), jnp.asarray(mask)))
    np.testing.assert_array_equal(got.reshape(B * Q, V), want)
    assert structured.apply_bitmask(logits, None) is logits


def test_advance_consumes_cuts_drafts_and_finishes(compiler):
    r = _row(compiler, SOP(regex="ab(c|d)"))
    seq = r.seq
    seq.output_token_ids = [ord("a")]
    seq.draft_token_ids = [ord("b"), ord("x"), ord("c")]
    assert structured.advance(seq, [ord("a")]) == [ord("a")]
    assert seq.draft_token_ids == [ord("b")] and seq.finish_reason is None  # longest grammar-valid prefix
    # A step that accepted b, c and emitted a bonus token after the completing c: the bonus is taken back.
    seq.output_token_ids += [ord("b"), ord("c"), 257]
    assert structured.advance(seq, [ord("b"), ord("c"), 257]) == [ord("b"), ord("c")]
    assert seq.output_token_ids == [ord(c) for c in "abc"] and seq.finish_reason == "stop"
    plain = Sequence("p", [1], jspec.SamplingParams(), 0, 0)
    assert structured.advance(plain, [5]) == [5]


@pytest.fixture(scope="module")
def llm():
    return jspec.LLM(default_model_path(), max_num_seqs=4, max_model_len=128, dtype="float32")


def test_bad_grammar_is_refused_and_other_requests_run(llm):
    eng = llm.engine
    eng.add_request("ok", "hello", jspec.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    eng.add_request("bad-later", "hi", jspec.SamplingParams(max_tokens=4, structured_outputs=SOP(regex="[ab]{2}")))
    # Valid without a tokenizer (SamplingParams), not for this vocabulary (the engine).
    bad = jspec.SamplingParams(structured_outputs=SOP(grammar="start: <[99999]>"))
    for call in (lambda: eng.add_request("bad", "hello", bad), lambda: llm.generate(["a", "b"], [bad.__class__(), bad])):
        with pytest.raises(SamplingParamsError, match="structured_outputs grammar is invalid.*Token range end"):
            call()
    assert "bad" not in eng._seqs and len(eng._seqs) == 2
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert set(done) == {"ok", "bad-later"} and len(done["ok"].outputs[0].token_ids) == 4
    assert re.fullmatch("[ab]{2}", done["bad-later"].outputs[0].text)


def test_engine_modes_mixed_batch_and_the_grammar_cache(llm):
    eng = llm.engine
    prompts = ["one", "two", "three"]
    free = jspec.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompts[:1], free)[0].token_ids
    so = SOP(regex="(yes|no)-[0-9]{3}")
    sp = [jspec.SamplingParams(temperature=t, seed=1, max_tokens=12, structured_outputs=so) for t in (0.0, 1.0)]
    n0 = eng.grammars.num_compiled
    outs = llm.generate(prompts, [free] + sp)
    assert outs[0].token_ids == alone  # an unconstrained row of a masked batch: bit for bit unchanged
    for o in outs[1:]:
        assert o.outputs[0].finish_reason == "stop" and re.fullmatch("(yes|no)-[0-9]{3}", o.outputs[0].text)
    assert eng.grammars.num_compiled == n0 + 1  # one grammar, compiled once for both requests
    # Async scheduling chains the masked batch (split steps); the unchained path gives the
    # same tokens, greedy and seeded alike.
    assert eng.stats()["num_chained_calls"] > 0
    for kw in (dict(num_scheduler_steps=4), dict(async_scheduling=False)):
        other = jspec.LLM(default_model_path(), max_num_seqs=4, max_model_len=128, dtype="float32", **kw)
        got = other.generate(prompts, [free] + sp)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in outs], kw
        assert (other.engine.stats()["num_chained_calls"] > 0) == other.engine.config.async_scheduling


def test_a_structured_step_is_dispatched_before_its_masks_are_built(llm, monkeypatch):
    """The chained step of a masked batch: its forward goes to the device, then the host
    reads the step before it and builds the masks (while the forward runs), then the tail."""
    from jspec.engine import sampling_step

    eng, events = llm.engine, []
    fwd, tail, collect, build = eng.runner.dispatch_forward, eng.runner.dispatch_tail, eng._collect, \
        sampling_step.build_bitmask
    monkeypatch.setattr(eng.runner, "dispatch_forward", lambda *a: events.append("forward") or fwd(*a))
    monkeypatch.setattr(eng.runner, "dispatch_tail", lambda *a: events.append("tail") or tail(*a))
    monkeypatch.setattr(eng, "_collect", lambda *a: events.append("read") or collect(*a))
    monkeypatch.setattr(sampling_step, "build_bitmask", lambda *a, **k: events.append("mask") or build(*a, **k))
    so = SOP(regex="[a-z]{6}")
    outs = llm.generate(["one", "two", "three"], [jspec.SamplingParams(temperature=t, seed=3, max_tokens=10,
                                                                      structured_outputs=so) for t in (0.0, 1.0, 1.0)])
    assert all(re.fullmatch("[a-z]{6}", o.outputs[0].text) for o in outs)
    split = "".join(e[0] for e in events)  # f(orward) r(ead) t(ail) m(ask)
    assert split.count("frtm") >= 4 and split.count("f") == split.count("frtm"), events


@pytest.mark.production_buckets
def test_warmup_compiles_the_masked_steps_when_asked(monkeypatch):
    from jspec.serve.cli import build_parser, engine_kwargs

    assert engine_kwargs(build_parser().parse_args(["--warmup-structured-outputs"]))["warmup_structured_outputs"]
    assert "warmup_structured_outputs" not in engine_kwargs(build_parser().parse_args([]))
    llm = jspec.LLM(default_model_path(), max_num_seqs=1, max_model_len=32, page_size=16, max_prefill_chunk=16,
                    dtype="float32", warmup_structured_outputs=True)
    eng = llm.engine
    eng.warmup()
    n = eng.runner.num_compilations + eng.runner.num_loaded  # compiled, or loaded (jspec/engine/executables.py)
    # unmasked and masked, both ways of filtering: the general steps (T 8, 16), the fed decode
    # call (N 1); the split step's forward and its tail (both ways)
    assert len(eng.warmup_shapes()) == 2 * 3 and n == 2 * 2 * 3 + 1 + 2
    llm.generate(["one"], jspec.SamplingParams(temperature=0, max_tokens=8, structured_outputs=SOP(regex="[a-z]{7}")))
    assert eng.runner.num_compilations + eng.runner.num_loaded == n and eng.num_chained_calls > 0


@pytest.mark.production_buckets
def test_warmup_compiles_the_masked_mixed_steps(monkeypatch):
    """A mixing engine: warmup also compiles the masked general steps, and a mixed step with a
    grammar in one row masks every row (all tokens allowed in the others), so it runs the
    compiled variant."""
    from tests.helpers.engine import drive

    llm = jspec.LLM(default_model_path(), max_num_seqs=2, max_model_len=64, page_size=16, max_prefill_chunk=16,
                    dtype="float32", warmup_structured_outputs=True, max_num_partial_prefills=1,
                    async_scheduling=False)
    eng, r = llm.engine, llm.engine.runner
    eng.warmup()
    # unmasked and masked: the general steps (T 8, 16, 18: prefill chunks, mixed steps),
    # the decode steps at N 1 / 2
    assert r.num_compilations + r.num_loaded == 2 * 2 * (len(r.shapes.tokens) + 2)  # both ways of filtering
    compiled, run = [], r.run

    def counting(inp, steps=0, prev=None):
        n = r.num_compilations
        out = run(inp, steps, prev)
        compiled.append(r.num_compilations - n)
        return out

    monkeypatch.setattr(r, "run", counting)
    free, prompt = jspec.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "a longer prompt, " * 3
    so = jspec.SamplingParams(temperature=0, max_tokens=12, structured_outputs=SOP(regex="[a-z]{10}"))
    done = drive(llm, {0: [("add", "g", "one", so)], 1: [("add", "free", prompt, free)]})
    assert len(compiled) >= 2 and not any(compiled), compiled  # the prompt's 3 chunks beside g's rows
    assert re.fullmatch("[a-z]{10}", eng.tokenizer.decode(done["g"][0])) and len(done["free"][0]) == 4


def test_a_model_without_tokenizer_refuses_structured_outputs(tmp_path):
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(default_model_path(), f), tmp_path / f)
    llm = jspec.LLM(str(tmp_path), max_num_seqs=2, max_model_len=64)
    with pytest.raises(SamplingParamsError, match="structured_outputs needs a tokenizer"):
        llm.generate([[1, 2, 3]], jspec.SamplingParams(structured_outputs=SOP(regex="a")))
