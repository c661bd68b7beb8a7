"""DFlash training loss (block diffusion drafting, the recipe speculators implements).

No shift: the context is ctx = hidden_norm(fc(target aux states)) at every position of the
row. Each of ``num_anchors`` random anchors a (per row, a <= T - block_size) opens a block
[x[a], MASK x (block_size - 1)] at positions a .. a + block_size - 1, embedded with the
target's embeddings. Block queries attend to the context strictly before a (projected by
each layer's k_proj / v_proj, k_norm and RoPE; no input_layernorm) and, non-causally, to
their own block; blocks never see each other. Slot j >= 1 is scored against the target's
distribution at a + j - 1 (the token x[a + j]) through the target's lm_head, weighted
exp(-(j - 1) / gamma); slot 0 (the bonus, known at inference) is not scored. That is the
inference step: context KV of verified positions, one non-causal block after them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ModelConfig
from jspec.drafters.config import DrafterConfig
from jspec.train.drafters import agree, kl, target_signals
from jspec.train.layers import attention, cast_tree, linear, mlp, rms_norm, rope
from kernels_pallas.rope_kv_write import rope_halves


def layer(lc: ModelConfig, p, x, ctx, rope_ctx, rope_blk, mask):
    """One DFlash layer. x: block rows [B, Q, H]; ctx: [B, C, H]; rope_*: (cos, sin) at the
    context's / the block's positions; mask: bool[B, Q, C + Q] over [context, block] keys."""
    B, Q, _ = x.shape
    a = p["attn"]
    xn = rms_norm(x, p["input_layernorm"]["weight"], lc.rms_norm_eps)
    q = linear(xn, a["q_proj"]["weight"]).reshape(B, Q, lc.num_heads, lc.head_dim)
    q = rope_halves(rms_norm(q, a["q_norm"]["weight"], lc.rms_norm_eps), *rope_blk)
    kv = linear(jnp.concatenate([ctx, xn], axis=1), a["kv_proj"]["weight"])
    S = kv.shape[1]
    k = rms_norm(kv[..., : lc.kv_size].reshape(B, S, lc.num_kv_heads, lc.head_dim), a["k_norm"]["weight"],
                 lc.rms_norm_eps)
    cos = jnp.concatenate([rope_ctx[0], rope_blk[0]], axis=1)
    sin = jnp.concatenate([rope_ctx[1], rope_blk[1]], axis=1)
    k = rope_halves(k, cos, sin)
    v = kv[..., lc.kv_size :].reshape(B, S, lc.num_kv_heads, lc.head_dim)
    x = x + linear(attention(q, k, v, mask), a["o_proj"]["weight"])
    return x + mlp(p["mlp"], rms_norm(x, p["post_attention_layernorm"]["weight"], lc.rms_norm_eps))


def slot_weights(block_size: int, gamma: float) -> np.ndarray:  # f32[bs]: 0, 1, e^(-1/g), ...
    j = np.arange(block_size)
    return np.where(j == 0, 0.0, np.exp(-np.maximum(j - 1, 0) / gamma)).astype(np.float32)


def random_anchors(key, batch: int, seq_len: int, block_size: int, num_anchors: int):
    """i32[B, A]: distinct sorted anchors per row in 0 .. T - block_size (every slot's
    target inside the row)."""
    pool = seq_len - block_size + 1
    perm = jax.vmap(lambda k: jax.random.permutation(k, pool))(jax.random.split(key, batch))
    return jnp.sort(perm[:, : min(num_anchors, pool)], -1).astype(jnp.int32)


def dflash_logits(params, frozen, tokens, anchors, *, dc: DrafterConfig, tc: ModelConfig, dtype=jnp.float32):
    """Blocks at ``anchors`` (i32[B, A]) over rows tokens i32[B, T].
    -> (draft logits f32[B, A * bs, V], the target's logits at each slot's position - 1)."""
    p = cast_tree(params, dtype)
    aux, tl = target_signals(frozen, tc, tokens, dc.aux_layer_ids, dtype)
    lc = dc.layer_config()
    (B, T), A, bs = tokens.shape, anchors.shape[1], dc.block_size
    slot = np.arange(bs)
    blk_pos = (anchors[:, :, None] + slot).reshape(B, A * bs)
    anchor_of = jnp.repeat(anchors, bs, axis=1)  # [B, A * bs]
    rows = jax.vmap(lambda a, i: a[i])
    blk_tok = jnp.where(jnp.asarray(np.tile(slot == 0, A)), rows(tokens, blk_pos), dc.mask_token_id)
    x = jnp.take(frozen["embed_tokens"]["embedding"].astype(dtype), blk_tok, axis=0)
    ctx = rms_norm(linear(aux.astype(dtype), p["fc"]["weight"]), p["hidden_norm"]["weight"], lc.rms_norm_eps)
    ctx_pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    block_id = np.arange(A * bs) // bs
    mask = jnp.concatenate([
        ctx_pos[:, None, :] < anchor_of[:, :, None],  # context strictly before the anchor
        jnp.broadcast_to(jnp.asarray(block_id[:, None] == block_id[None, :]), (B, A * bs, A * bs)),
    ], axis=-1)
    rope_ctx, rope_blk = rope(lc, ctx_pos), rope(lc, blk_pos)
    for i in range(dc.num_layers):
        x = layer(lc, p[f"layers_{i}"], x, ctx, rope_ctx, rope_blk, mask)
    h = rms_norm(x, p["norm"]["weight"], lc.rms_norm_eps)
    lm_head = p["lm_head"] if "lm_head" in p else frozen["lm_head"].astype(dtype)
    lg = jnp.einsum("bqh,vh->bqv", h, lm_head, preferred_element_type=jnp.float32)
    return lg, rows(tl, jnp.maximum(blk_pos - 1, 0))  # slot 0 of anchor 0 has none: unscored


def dflash_loss(params, frozen, tokens, key, *, dc: DrafterConfig, tc: ModelConfig, num_anchors: int = 64,
                gamma: float = 4.0, dtype=jnp.float32):
    B, T = tokens.shape
    bs = dc.block_size
    anchors = random_anchors(key, B, T, bs, num_anchors)
    lg, t = dflash_logits(params, frozen, tokens, anchors, dc=dc, tc=tc, dtype=dtype)
    A = anchors.shape[1]
    w = jnp.asarray(np.tile(slot_weights(bs, gamma), A))
    loss = jnp.sum(kl(t, lg) * w) / (B * jnp.sum(w))
    hit = agree(t, lg).reshape(B, A, bs)[:, :, 1:]
    metrics = {f"acc_{j}": jnp.mean(hit[:, :, j - 1]) for j in range(1, bs)}
    # Greedy acceptance length of a block: the bonus plus the run of leading agreements.
    metrics["accept_len"] = 1.0 + jnp.mean(jnp.sum(jnp.cumprod(hit, axis=-1), axis=-1))
    return loss, metrics


def loss_fn(dc: DrafterConfig, tc: ModelConfig, dtype=jnp.float32, **kw):
    return functools.partial(dflash_loss, dc=dc, tc=tc, dtype=dtype, **kw)
