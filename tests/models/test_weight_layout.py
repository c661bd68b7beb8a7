"""The CPU plan's [in, out] weight layout (jspec.ops.KernelPlan.in_out_weights, made by
plan_kernels on CPU) computes what the [out, in] reference plan computes: which leaves
plan_params transposes, and the family's target (one decode row, a verification block, the
aux states, the logits) and its three drafters under both plans, on the same weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import family, ops
from jspec.checkpoint.target import load_target
from jspec.drafters import DFlashDrafter, Eagle3Drafter, create_kv_cache, load_drafter
from jspec.drafters.propose import span_metadata
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.transformer import Transformer

HF = ops.KernelPlan()  # [out, in], the reference
PAGE, NPAGES = 16, 8
PAGES = [5, 2, 7, 0, 3, 1, 6, 4]
TOKENS = np.array([112, 1999, 47, 300, 8, 2048, 77, 5000, 15, 901, 33, 4096], np.int32)


@pytest.fixture(scope="module")
def target():
    cfg, params = load_target(family.TARGET, "float32")
    return cfg, params, ops.plan_kernels(cfg, backend="cpu")


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def test_plan_params_transposes_the_projection_weights_only(target):
    cfg, params, cpu = target
    assert cpu.in_out_weights and ops.plan_params(HF, params) is params
    moved = ops.plan_params(cpu, params)
    flat, held = jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(moved)
    assert [p[-1].key for p, _ in flat].count("lm_head") == 1
    for (path, a), b in zip(flat, held):
        if a.ndim == 2 and path[-1].key in ("weight", "lm_head"):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a).T)
        else:  # embeddings, norms
            assert b is a
    assert moved["embed_tokens"]["embedding"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert moved["lm_head"].shape == ops.weight_shape(cpu, cfg.vocab_size, cfg.hidden_size)


def _forward(cfg, plan, params, q_len, aux_layers=(1, 4, 7)):
    """hidden, aux, logits and the KV written by the target over the last q_len of TOKENS,
    after the others (so a decode row also reads cached keys)."""
    kv = KVCache.create(cfg.num_layers, NPAGES, PAGE, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    m, v = Transformer(cfg, plan=plan), {"params": ops.plan_params(plan, params)}
    start = len(TOKENS) - q_len
    if start:
        meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, start, NPAGES)
        _, _, kv = m.apply(v, jnp.asarray(TOKENS[None, :start]), meta, kv)
    meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, start, q_len, NPAGES)
    h, aux, kv = m.apply(v, jnp.asarray(TOKENS[None, start:]), meta, kv, aux_layers=aux_layers)
    return h, aux, m.apply(v, h, method=Transformer.logits), kv


@pytest.mark.parametrize("q_len", [1, 8])  # a decode row (XLA's GEMV), a K=7 verification block (a GEMM)
def test_target_forward_equals_the_reference_layout(target, q_len):
    cfg, params, cpu = target
    ref, got = _forward(cfg, HF, params, q_len), _forward(cfg, cpu, params, q_len)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        close(a, b)
    assert (np.asarray(got[2]).argmax(-1) == np.asarray(ref[2]).argmax(-1)).all()


def _drafter_logits(method, plan, cfg, params, dcfg, dparams):
    """The drafter's logits f32[n, V] under ``plan`` from the same target states."""
    tv = {"params": ops.plan_params(plan, params)}
    dv = {"params": ops.plan_params(plan, dparams)}
    _, aux, _, _ = _forward(cfg, plan, params, len(TOKENS), tuple(dcfg.aux_layer_ids))
    aux = aux.reshape(1, len(TOKENS), -1)
    embed = params["embed_tokens"]["embedding"]
    kv = create_kv_cache(dcfg, NPAGES, PAGE, jnp.float32)
    meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, len(TOKENS), NPAGES)
    if method == "dflash":
        m = DFlashDrafter(dcfg, plan=plan)
        kv = m.apply(dv, aux, meta, kv, method=DFlashDrafter.write_context)
        bs = dcfg.block_size
        block = span_metadata(meta.page_table, jnp.asarray([len(TOKENS)]), bs, jnp.asarray([True]), PAGE, NPAGES,
                              causal=False)
        h, _ = m.apply(dv, jnp.asarray([[9] + [dcfg.mask_token_id] * (bs - 1)]), block, kv, embed)
        head = Transformer(cfg, plan=plan).apply(tv, method=Transformer.lm_head_weight)
        return m.apply(dv, h[:, 1:], head, method=DFlashDrafter.logits)[0]
    m = Eagle3Drafter(dcfg, plan=plan)
    pairs = jnp.asarray(np.roll(TOKENS, -1)[None])
    table = None if dcfg.has_own_embeddings else embed
    h, _ = m.apply(dv, pairs, aux, meta, kv, table, hidden_is_fc_input=True)
    return m.apply(dv, h, method=Eagle3Drafter.logits)[0]


@pytest.mark.parametrize("method", family.METHODS)
def test_drafters_equal_the_reference_layout(target, method):
    cfg, params, cpu = target
    dcfg, dparams = load_drafter(family.drafter_for(None, method), cfg, "float32")
    ref = _drafter_logits(method, HF, cfg, params, dcfg, dparams)
    got = _drafter_logits(method, cpu, cfg, params, dcfg, dparams)
    close(got, ref)
    assert (np.asarray(got).argmax(-1) == np.asarray(ref).argmax(-1)).all()
