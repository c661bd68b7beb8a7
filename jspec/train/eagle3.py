"""EAGLE3 and PEagle training losses (the published recipes, as speculators implements them).

Both read the shifted pairs of inference: row i pairs token x[i+1] with the target's aux
states at i and is trained towards the target's distribution at i+1 (KL(p_target || q)).

EAGLE3, training-time test (``eagle3_loss``): the drafter is unrolled ``ttt_steps`` times.
Step k feeds back step k-1's *pre-norm* outputs as the hidden inputs, with the corpus tokens
shifted by k (teacher forcing) at positions + k; a query attends causally over step 0's
keys and to its own keys of steps 1..k (the diagonals), which is exactly what the K-1
single-token draft steps see at inference. Step k is scored against the target at i+1+k,
weighted ``decay ** k`` (EAGLE's 0.8 by default).

PEagle, parallel drafting (``peagle_loss``): conditional-on-distribution (COD) sampling.
Depth 0 is every pair; depth d keeps a random subset of anchors of size
``max(ratio ** d, ratio_min)`` of the pool, nested in depth d-1's, each element a mask slot
(mask_token_id, learned mask_hidden) at position anchor + d scored against the target at
anchor + d + 1. A depth-d element attends to depth-0 pairs up to its anchor and to its own
rollout's lower depths: the forward over [pairs..., bonus, MASK x (K-1)] at inference.
Sizes are static (fixed counts per depth, random anchors per row), so one compile serves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jspec.config import ModelConfig
from jspec.drafters.config import DrafterConfig
from jspec.train.drafters import agree, kl, target_signals
from jspec.train.layers import cast_tree, causal_mask, decoder_layer, linear, mlp, rms_norm, rope, self_attention


def forward(dc: DrafterConfig, p, emb, hidden, cos, sin, mask, past=None):
    """The EAGLE3 / PEagle decoder over (embedding, fc-space hidden) pairs.

    emb, hidden: [B, T, H]; mask: bool[B | 1, T, S] over [past keys..., own keys];
    past: per layer, the (k, v) pairs of earlier passes. -> (pre-norm out [B, T, H], this
    pass's (k, v) per layer).
    """
    lc = dc.layer_config()
    past = past or [()] * dc.num_layers
    l0 = p["layers_0"]
    e = rms_norm(emb, l0["input_layernorm"]["weight"], lc.rms_norm_eps)
    hn = rms_norm(hidden, l0["hidden_norm"]["weight"], lc.rms_norm_eps)
    a, kv = self_attention(lc, l0["attn"], jnp.concatenate([e, hn], -1), cos, sin, mask, past[0])
    x = (hn if dc.norm_before_residual else hidden) + a
    x = x + mlp(l0["mlp"], rms_norm(x, l0["post_attention_layernorm"]["weight"], lc.rms_norm_eps))
    kvs = [kv]
    for i in range(1, dc.num_layers):
        x, kv = decoder_layer(lc, p[f"layers_{i}"], x, cos, sin, mask, past[i])
        kvs.append(kv)
    return x, kvs


def draft_logits(dc: DrafterConfig, p, x):  # pre-norm [..., H] -> f32[..., Vd]
    h = rms_norm(x, p["norm"]["weight"], dc.rms_norm_eps)
    return jnp.einsum("...h,vh->...v", h, p["lm_head"], preferred_element_type=jnp.float32)


def _embed_table(dc: DrafterConfig, p, frozen, dtype):
    return p["embed_tokens"] if dc.has_own_embeddings else frozen["embed_tokens"]["embedding"].astype(dtype)


def ttt_logits(params, frozen, tokens, *, dc: DrafterConfig, tc: ModelConfig, ttt_steps: int, dtype=jnp.float32):
    """The training-time-test unroll over rows tokens i32[B, T] (N = T - 1 pairs).
    -> (per step k, draft logits f32[B, N - k, V] of pairs 0..N-k-1; the target's logits
    f32[B, N, V] at positions 1..N). Step k's row i is scored against target row i + k."""
    p = cast_tree(params, dtype)
    aux, tl = target_signals(frozen, tc, tokens, dc.aux_layer_ids, dtype)
    B, T = tokens.shape
    N = T - 1
    ids = tokens[:, 1:]  # pair i: token x[i+1] with the aux states at i
    h = linear(aux[:, :-1].astype(dtype), p["fc"]["weight"])
    table = _embed_table(dc, p, frozen, dtype)
    causal, diag = causal_mask(N), jnp.eye(N, dtype=bool)[None]
    past = [()] * dc.num_layers
    steps = []
    for k in range(ttt_steps):
        ids_k = jnp.pad(ids[:, k:], ((0, 0), (0, k)))  # past the end: padding, never scored
        cos, sin = rope(dc.layer_config(), jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32) + k, (B, N)))
        x, kvs = forward(dc, p, jnp.take(table, ids_k, axis=0), h, cos, sin,
                         jnp.concatenate([causal] + [diag] * k, axis=-1), past)
        past = [pl + (kv,) for pl, kv in zip(past, kvs)]
        steps.append(draft_logits(dc, p, x[:, : N - k]))
        h = x  # the pre-norm output is the next step's hidden input
    return steps, tl[:, 1:]


def eagle3_loss(params, frozen, tokens, key, *, dc: DrafterConfig, tc: ModelConfig, ttt_steps: int = 3,
                decay: float = 0.8, dtype=jnp.float32):
    del key
    steps, target = ttt_logits(params, frozen, tokens, dc=dc, tc=tc, ttt_steps=ttt_steps, dtype=dtype)
    loss, metrics = 0.0, {}
    for k, lg in enumerate(steps):
        step_kl = jnp.mean(kl(target[:, k:], lg))
        loss = loss + decay**k * step_kl
        metrics[f"kl_{k}"] = step_kl
        metrics[f"acc_{k}"] = jnp.mean(agree(target[:, k:], lg))
    return loss, metrics


def cod_counts(n_pairs: int, depths: int, ratio: float, ratio_min: float) -> list[int]:
    """Elements per depth: every pair at depth 0, then a shrinking share of the anchor pool
    (anchors whose whole rollout lies inside the row)."""
    pool = n_pairs - (depths - 1)
    if pool < 1:
        raise ValueError(f"rows of {n_pairs + 1} tokens are too short for {depths} PEagle depths")
    return [n_pairs] + [max(1, int(pool * max(ratio**d, ratio_min))) for d in range(1, depths)]


def cod_layout(key, batch: int, counts: list[int]):
    """(anchor i32[B, M], depth int[M] static): depth 0 is every pair; depth d the first
    counts[d] anchors of one random order per row, sorted, so every rollout present at
    depth d is present at all lower depths."""
    depths, N = len(counts), counts[0]
    perm = jax.vmap(lambda k: jax.random.permutation(k, N - (depths - 1)))(jax.random.split(key, batch))
    anchor = jnp.concatenate(
        [jnp.broadcast_to(jnp.arange(N), (batch, N))] + [jnp.sort(perm[:, :n], -1) for n in counts[1:]], axis=1)
    return anchor.astype(jnp.int32), np.repeat(np.arange(depths), counts)


def peagle_logits(params, frozen, tokens, anchor, depth, *, dc: DrafterConfig, tc: ModelConfig, dtype=jnp.float32):
    """One parallel forward over the COD layout (anchor i32[B, M], depth int[M]).
    -> (draft logits f32[B, M, V], the target's logits at each element's position + 1)."""
    p = cast_tree(params, dtype)
    aux, tl = target_signals(frozen, tc, tokens, dc.aux_layer_ids, dtype)
    ids, g, target = tokens[:, 1:], aux[:, :-1].astype(dtype), tl[:, 1:]
    pos = anchor + jnp.asarray(depth, jnp.int32)  # [B, M]
    is_pair = jnp.asarray(depth == 0)
    rows = jax.vmap(lambda a, i: a[i])
    tok = jnp.where(is_pair, rows(ids, pos), dc.mask_token_id)
    hid = jnp.where(is_pair[:, None], rows(g, pos), p["mask_hidden"])
    dq, dk = jnp.asarray(depth)[None, :, None], jnp.asarray(depth)[None, None, :]
    aq, ak = anchor[:, :, None], anchor[:, None, :]
    mask = ((dk == 0) & (ak <= aq)) | ((ak == aq) & (dk <= dq))  # [B, M, M]
    cos, sin = rope(dc.layer_config(), pos)
    x, _ = forward(dc, p, jnp.take(p["embed_tokens"], tok, axis=0), linear(hid, p["fc"]["weight"]), cos, sin, mask)
    return draft_logits(dc, p, x), rows(target, pos)


def peagle_loss(params, frozen, tokens, key, *, dc: DrafterConfig, tc: ModelConfig, depths: int = 5,
                ratio: float = 0.7, ratio_min: float = 0.2, dtype=jnp.float32):
    counts = cod_counts(tokens.shape[1] - 1, depths, ratio, ratio_min)
    anchor, depth = cod_layout(key, tokens.shape[0], counts)
    lg, t = peagle_logits(params, frozen, tokens, anchor, depth, dc=dc, tc=tc, dtype=dtype)
    hit = agree(t, lg)
    starts = np.cumsum([0] + counts)
    metrics = {f"acc_{d}": jnp.mean(hit[:, starts[d] : starts[d + 1]]) for d in range(depths)}
    return jnp.mean(kl(t, lg)), metrics


def loss_fn(dc: DrafterConfig, tc: ModelConfig, dtype=jnp.float32, **kw):
    fn = eagle3_loss if dc.method == "eagle3" else peagle_loss
    return functools.partial(fn, dc=dc, tc=tc, dtype=dtype, **kw)

