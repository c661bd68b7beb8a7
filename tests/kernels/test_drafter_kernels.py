"""Drafters on the target's glue kernels (make_drafter: KernelPlan.for_draft_model): their
layers in bf16 with the kernels in Pallas' interpreter == the XLA plan within bf16 rounding,
and lowered for cuda each forward reaches the kernels a target layer of its width takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.checkpoint.param_spec import set_path
from jspec.config import RopeConfig
from jspec.drafters import DFlashDrafter, Eagle3Drafter, create_kv_cache
from jspec.drafters.config import DrafterConfig
from jspec.drafters.loader import drafter_param_spec
from jspec.drafters.propose import span_metadata
from jspec.drafters.registry import make_drafter
from jspec.kv_cache import AttentionMetadata
from jspec.ops import plan_kernels, plan_params
from tests.helpers.drafters import NPAGES, PAGE, PAGES
from tests.helpers.lowering import custom_calls, lower

BF16 = jnp.bfloat16


def rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def random_params(dc: DrafterConfig, seed: int = 5):
    """The drafter's parameter tree (HF layout), bf16: norms around 1, weights small."""
    params = {}
    for i, s in enumerate(drafter_param_spec(dc)):
        k = jax.random.fold_in(jax.random.PRNGKey(seed), i)
        if s.integer:  # d2t
            set_path(params, s.path, jnp.zeros(s.shape, jnp.int32))
            continue
        base = 1.0 if len(s.shape) == 1 and "norm" in "/".join(s.path) else 0.0
        set_path(params, s.path, (base + 0.05 * jax.random.normal(k, s.shape)).astype(BF16))
    return params


def test_eagle3_chain_on_the_glue_kernels_matches_the_xla_plan(gpu_target):
    """EAGLE3 / PEagle (two layers: the 2H-input first layer, then a target layer) on the
    target's kernels: the first pass over 4 pairs (a verification-width forward:
    fused_linear_rows, o_proj handing the post-attention norm over, down_proj the second
    layer's input norm) and a one-row step (fused_linear's one-row kernels) == the XLA plan."""
    bf16, Hd = BF16, 128
    dc = DrafterConfig(method="peagle", source_format="speculators", family="llama", hidden_size=Hd,
                       intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       rms_norm_eps=1e-5, rope=RopeConfig(5e5), draft_vocab_size=192, target_vocab_size=256,
                       target_hidden_size=Hd, aux_layer_ids=(1, 2, 3), norm_before_residual=True,
                       norm_before_fc=False, has_own_embeddings=False, has_d2t=True, mask_token_id=255,
                       block_size=None, num_speculative_tokens=3, qk_norm=False, attention_bias=False,
                       mlp_bias=False, max_position_embeddings=4096)
    params = random_params(dc)
    k = jax.random.split(jax.random.PRNGKey(6), 3)
    embed_t = (0.5 * jax.random.normal(k[0], (256, Hd))).astype(bf16)
    aux = jax.random.normal(k[1], (1, 4, 3 * Hd)).astype(bf16)
    first = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, 4, NPAGES)
    step = span_metadata(first.page_table, jnp.asarray([4]), 1, jnp.asarray([True]), PAGE, NPAGES, causal=True)
    tokens = jnp.asarray([[5, 9, 17, 33]])

    def run(plan):
        m = make_drafter(dc, dtype=bf16, plan=plan).module
        p = {"params": plan_params(plan, params)}
        kv = create_kv_cache(dc, NPAGES, PAGE, bf16)
        h, kv = m.apply(p, tokens, aux, first, kv, embed_t, hidden_is_fc_input=True)
        h1, _ = m.apply(p, jnp.asarray([[40]]), h[:, -1:], step, kv, embed_t, hidden_is_fc_input=False)
        return h, h1, m.apply(p, h1[:, 0], method=Eagle3Drafter.logits)

    ref = run(plan_kernels(dc.layer_config(), attn_impl="reference", linear_impl="reference", backend="cpu"))
    interp = plan_kernels(dc.layer_config(), attn_impl="reference", linear_impl="interpret", backend="cpu")
    assert make_drafter(dc, dtype=bf16, plan=interp).module.plan.norm_handoff
    for got, want in zip(run(interp), ref):
        assert rel(got, want) < 3e-2

    m = make_drafter(dc, dtype=bf16, plan=plan_kernels(dc.layer_config(), backend="gpu")).module
    shapes = jax.eval_shape(lambda: (params, create_kv_cache(dc, NPAGES, PAGE, bf16)))
    names = [n for _, n in custom_calls(lower(
        lambda p, kv: m.apply({"params": p}, tokens, aux, first, kv, embed_t, hidden_is_fc_input=True), shapes, "cuda"))]
    assert any(n.startswith("fused_linear_rows_r4_") and n.endswith("_norm_out") for n in names), names  # o_proj
    assert any(n.startswith("fused_linear_rows_r4_") and n.endswith("_swiglu_norm_in") for n in names), names
    assert any(n.startswith("fused_linear_rows_r4_") and "_norm_in" in n and "_swiglu" not in n
               for n in names), names  # layer 1's qkv on the norm down_proj handed over
    assert "rope_kv_write" in names, names
    h = jax.ShapeDtypeStruct((1, 1, Hd), bf16)
    names = [n for _, n in custom_calls(lower(
        lambda p, kv, h: m.apply({"params": p}, jnp.asarray([[40]]), h, step, kv, embed_t, hidden_is_fc_input=False),
        (*shapes, h), "cuda"))]
    assert any(n.startswith("fused_linear_silu_mul_") for n in names), names  # down + SwiGLU + residual
    assert any(n.startswith("fused_linear_none_") for n in names), names  # o_proj + residual + norm hand-over


def test_dflash_block_on_the_glue_kernels_matches_the_xla_plan(gpu_target):
    """DFlash's layers run the target's glue kernels (make_drafter: for_draft_model): at one
    sequence its block of 16 rows takes fused_linear_rows, each layer's norms handed over as
    in the target, and the block's and the context's K/V go through rope_kv_write (k|v only
    for the context). bf16, the kernels in Pallas' interpreter == the XLA plan's block
    within bf16 rounding (hidden states and logits), and lowered for cuda the forward and
    the context write reach them."""
    bf16, Hd, n_aux, bs = BF16, 128, 2, 16
    dc = DrafterConfig(method="dflash", source_format="speculators", family="qwen3", hidden_size=Hd,
                       intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                       rms_norm_eps=1e-6, rope=RopeConfig(1e6), draft_vocab_size=256, target_vocab_size=256,
                       target_hidden_size=Hd, aux_layer_ids=(1, 3), norm_before_residual=False, norm_before_fc=False,
                       has_own_embeddings=False, has_d2t=False, mask_token_id=255, block_size=bs,
                       num_speculative_tokens=None, qk_norm=True, attention_bias=False, mlp_bias=False,
                       max_position_embeddings=4096)
    params = random_params(dc)
    kt = jax.random.split(jax.random.PRNGKey(6), 3)
    embed_t, head_t = (0.5 * jax.random.normal(kt[0], (256, Hd))).astype(bf16), \
        (0.05 * jax.random.normal(kt[1], (256, Hd))).astype(bf16)
    aux = jax.random.normal(kt[2], (1, 10, n_aux * Hd)).astype(bf16)
    ctx_meta = AttentionMetadata.for_single_sequence(PAGES, PAGE, 0, 10, NPAGES)
    block = span_metadata(ctx_meta.page_table, jnp.asarray([10]), bs, jnp.asarray([True]), PAGE, NPAGES, causal=False)
    tokens = jnp.asarray([[7] + [255] * (bs - 1)])

    def run(plan):
        m = make_drafter(dc, dtype=bf16, plan=plan).module
        p = {"params": plan_params(plan, params)}
        kv = create_kv_cache(dc, NPAGES, PAGE, bf16)
        kv = m.apply(p, aux, ctx_meta, kv, method=DFlashDrafter.write_context)
        h, _ = m.apply(p, tokens, block, kv, embed_t)
        head = head_t.T if plan.in_out_weights else head_t
        return h, m.apply(p, h, head, method=DFlashDrafter.logits)

    h0, l0 = run(plan_kernels(dc.layer_config(), attn_impl="reference", linear_impl="reference", backend="cpu"))
    interp = plan_kernels(dc.layer_config(), attn_impl="reference", linear_impl="interpret", backend="cpu")
    assert make_drafter(dc, dtype=bf16, plan=interp).module.plan.norm_handoff
    h1, l1 = run(interp)
    assert rel(h1, h0) < 3e-2
    assert rel(l1, l0) < 3e-2

    m = make_drafter(dc, dtype=bf16, plan=plan_kernels(dc.layer_config(), backend="gpu")).module
    shapes = jax.eval_shape(lambda: (params, create_kv_cache(dc, NPAGES, PAGE, bf16)))

    def fwd(p, kv):
        return m.apply({"params": p}, tokens, block, kv, embed_t)
    names = [n for _, n in custom_calls(lower(fwd, shapes, "cuda"))]
    assert any(n.startswith("fused_linear_rows_r16_") and n.endswith("_swiglu_norm_in") for n in names), names
    assert any(n.startswith("fused_linear_rows_r16_") and n.endswith("_norm_out") for n in names), names
    assert "rope_kv_write" in names, names  # the block's q|k|v: norms, RoPE, KV write
    ctx = jax.ShapeDtypeStruct(aux.shape, bf16)
    names = [n for _, n in custom_calls(lower(
        lambda p, kv, a: m.apply({"params": p}, a, ctx_meta, kv, method=DFlashDrafter.write_context),
        (*shapes, ctx), "cuda"))]
    assert names == ["rope_kv_write_kv_only"], names  # the context's k|v
