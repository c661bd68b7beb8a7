"""Issue 64 must-show: tensor parallelism for a vocabulary it does not divide.

The Llama target and the drafters of tests/helpers/parallel.py over 61 tokens (reduced draft
vocabularies of 45; the draft model a Qwen3): neither tp 2 nor tp 4 divides either. Their
embeddings and lm_heads are held padded with zero rows to a multiple of tp (jspec/parallel:
Placement.shape) and the logits are sliced back to the real vocabulary right after the
lm_head (ops.logits), so: greedy outputs at tp 2 and 4 equal tp 1's, plain and with every
drafter kind (EAGLE3 with a reduced vocabulary and with the whole one, PEagle, DFlash over
the target's lm_head, a draft model); seeded temperature-1 outputs equal tp 1's, plain and
speculative; every id emitted, sampled or in the logprobs (the whole vocabulary asked for),
is below 61; each device holds its share of the parameter bytes; an orbax copy, dummy
weights and a tied lm_head are padded alike. One engine per configuration, shared by the
tests (h.llm's cache).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from jspec import parallel
from tests.helpers import parallel as h

V = 61
PROMPTS = h.prompts(2, 6, 15, seed=0, vocab=V)
N = 12

# (drafter, tp) over the Llama: every drafter kind once, tp 2 and 4 each (DFlash with the
# target's lm_head: its own would be EAGLE3's reduced head again; the draft model is a Qwen3).
SPEC_CASES = [("eagle3", 2), ("eagle3_full", 4), ("peagle", 4), ("draft_model", 2), ("dflash_full", 2)]


def llm(name, tp):
    return h.llm("llama", name, tp, vocab=V, max_logprobs=-1)


def run(engine, **sp):
    import jspec

    params = jspec.SamplingParams(max_tokens=N, ignore_eos=True, **{"temperature": 0.0, **sp})
    return engine.generate(PROMPTS, params)


def ids(outs) -> list[list[int]]:
    return [o.token_ids for o in outs]


_REF: dict = {}


def reference(**sp):
    """The plain tp-1 engine's outputs, logprobs of the whole vocabulary included (the
    plain engines' one compiled variant: greedy and seeded rows alike)."""
    key = tuple(sorted(sp.items()))
    if key not in _REF:
        _REF[key] = run(llm(None, 1), logprobs=-1, **sp)
    return _REF[key]


def logprobs(outs) -> np.ndarray:
    """f32[prompts, N, V]: every position's logprobs, which must cover exactly the real
    vocabulary (no padded id)."""
    rows = [o.outputs[0].logprobs for o in outs]
    assert all(sorted(r) == list(range(V)) for x in rows for r in x)
    return np.asarray([[[r[t].logprob for t in range(V)] for r in x] for x in rows])


def test_plain_across_tp():
    """Greedy and seeded at tp 4 equal tp 1, logprobs too (float32 rounding of the sharded
    sums aside); nothing emitted or listed outside the vocabulary."""
    tp4 = llm(None, 4)
    want, got = reference(), run(tp4, logprobs=-1)
    assert len({tuple(x) for x in ids(want)}) == len(PROMPTS)  # not one repeated answer
    assert ids(got) == ids(want)
    np.testing.assert_allclose(logprobs(got), logprobs(want), rtol=0, atol=1e-4)
    want, got = reference(temperature=1.0, seed=7), run(tp4, logprobs=-1, temperature=1.0, seed=7)
    assert ids(got) == ids(want)
    logprobs(got)
    assert max(max(x) for x in ids(got)) < V


@pytest.mark.parametrize("name,tp", SPEC_CASES, ids=[f"{d}-tp{tp}" for d, tp in SPEC_CASES])
def test_spec_greedy_across_tp(name, tp):
    eng = llm(name, tp)
    before = eng.engine.stats()["num_accepted_tokens"]
    assert ids(run(eng)) == ids(reference())  # greedy speculative decoding is lossless
    assert eng.engine.stats()["num_accepted_tokens"] > before  # the accept paths ran


def test_spec_seeded_across_tp():
    """Seeded EAGLE3 (reduced vocabulary: its draft probabilities scattered through d2t
    into the rejection sampler) at tp 2 equals tp 1, within the vocabulary."""
    want = ids(run(llm("eagle3", 1), temperature=1.0, seed=5))
    assert ids(run(llm("eagle3", 2), temperature=1.0, seed=5)) == want
    assert max(max(x) for x in want) < V


def test_params_per_device_and_padding():
    """tp 4 (EAGLE3 over the whole vocabulary, its own embeddings): target and drafter each
    hold within 10% of their checkpoint's bytes / 4 on every device; each vocabulary table
    holds 16 rows a device (61 padded to 64), the padded ones zero."""
    from jspec.checkpoint.target import target_param_spec
    from jspec.drafters.loader import drafter_param_spec

    r = llm("eagle3_full", 4).engine.runner
    for tree, specs in ((r.params, target_param_spec(r.cfg)), (r.dparams, drafter_param_spec(r.dcfg))):
        total = sum(np.prod(s.shape) * 4 for s in specs)  # float32, unpadded
        per_device = parallel.device_param_bytes(tree)
        assert len(per_device) == 4
        assert all(abs(n - total / 4) <= 0.1 * total / 4 for n in per_device.values()), (per_device, total)
    # embeddings [Vp, H]; lm_heads [H, Vp] (the CPU plan's [in, out] weights)
    tables = ((r.params["embed_tokens"]["embedding"], 0), (r.dparams["embed_tokens"], 0), (r.params["lm_head"], 1),
              (r.dparams["lm_head"], 1))
    for table, axis in tables:
        assert table.shape[axis] == parallel.padded_vocab(V, 4) == 64
        assert {s.data.shape[axis] for s in table.addressable_shards} == {16}
        assert not np.asarray(table).take(range(V, 64), axis=axis).any()


def test_load_paths_and_tied_head(tmp_path):
    """An orbax copy restores the same padded, sharded leaves as the per-device safetensors
    read; a tied lm_head (the padded embedding table, load_format="dummy": one model at
    every tp) embeds and gives logits at tp 4 as at tp 1."""
    import jax.numpy as jnp

    from jspec.checkpoint.target import flat_params, load_target, save_orbax
    from jspec.models.transformer import Transformer
    from jspec.ops import plan_kernels, plan_params

    folder, _ = h.target("llama", V)
    place = parallel.Placement(parallel.make_mesh(4), 4)
    copy = tmp_path / "orbax_copy"
    copy.mkdir()
    shutil.copy(os.path.join(folder, "config.json"), copy)
    save_orbax(load_target(folder, "float32")[1], str(copy))
    a = flat_params(load_target(folder, "float32", sharding=place)[1])
    b = flat_params(load_target(str(copy), "float32", sharding=place)[1])
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].sharding.is_equivalent_to(a[k].sharding, a[k].ndim), k
        np.testing.assert_array_equal(np.asarray(b[k]), np.asarray(a[k]), err_msg=k)
    assert a["lm_head"].shape == a["embed_tokens/embedding"].shape == (64, h.H)

    tied = tmp_path / "tied"  # config.json alone: dummy weights
    tied.mkdir()
    with open(os.path.join(folder, "config.json")) as f:
        (tied / "config.json").write_text(json.dumps({**json.load(f), "tie_word_embeddings": True}))
    tokens = jnp.asarray([PROMPTS[0]], jnp.int32)

    def embed_and_logits(tp):
        mesh = parallel.make_mesh(tp)
        cfg, params = load_target(str(tied), "float32", sharding=parallel.Placement(mesh, tp) if mesh else None,
                                  load_format="dummy")
        plan = plan_kernels(cfg, tp=tp, mesh=mesh)
        model, v = Transformer(cfg, plan=plan), {"params": plan_params(plan, params)}
        x = jax.jit(lambda v: model.apply(v, tokens, method=Transformer.embed))(v)
        return np.asarray(x), np.asarray(jax.jit(lambda v, x: model.apply(v, x, method=Transformer.logits))(v, x))

    (x1, want), (x4, got) = embed_and_logits(1), embed_and_logits(4)
    np.testing.assert_array_equal(x4, x1)  # one row of one device each: exact
    assert want.shape[-1] == got.shape[-1] == V
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
