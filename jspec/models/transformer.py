"""Llama 3.x / Qwen3 decoder over the paged KV cache (Flax linen).

One forward serves prefill chunks, decode and multi-token verification: queries are
``tokens: i32[B, Q]`` at ``positions`` (inside ``AttentionMetadata``); the new K/V are
scattered into the paged cache first, then every query attends over its sequence's pages.

Besides the final-normed hidden states, the forward returns the residual stream at any
requested *canonical* indices (c = input of decoder layer c; c = 0 is the embedding output,
c = L the last layer's output before the final norm), captured in the same pass.

Parameter tree (HF names -> ours are mapped in jspec/checkpoint/target.py):
  embed_tokens/embedding [V, H]; layers_i/{input_layernorm, post_attention_layernorm}/weight [H];
  layers_i/attn/qkv_proj/weight [(Hq + 2 Hkv) * D, H] (+ bias); layers_i/attn/o_proj/weight;
  layers_i/attn/{q_norm,k_norm}/weight [D] (Qwen3); layers_i/mlp/gate_up_proj/weight [2I, H];
  layers_i/mlp/down_proj/weight [H, I]; norm/weight [H]; lm_head [V, H] (untied only).
  Under tensor parallelism V of embed_tokens and lm_head is padded to a multiple of tp
  (ops.vocab_rows, zero rows); the logits are the real vocabulary's.
  A Qwen3-MoE layer's mlp instead: gate/weight [E, H] (the router), gate_up [E, 2I, H], down [E, H, I];
  gpt-oss's also gate/bias [E], gate_up_bias [E, 2I], down_bias [E, H], and attn/sinks [heads].
Projection weights (``weight``, ``lm_head``) are [in, out] under the CPU plan (ops.weight_shape).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn

from jspec import ops
from jspec.config import ModelConfig
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.layers import GatedMLP, Linear, MoE, NormWeight, RMSNorm, param, rope_for
from jspec.ops import KernelPlan


class Attention(nn.Module):
    """Self-attention over the paged cache: qkv projection, (qk-norm,) RoPE and the KV
    write, paged attention, o_proj. q/k/v read ``in_features`` (0: hidden_size; EAGLE3's
    first drafter layer reads 2H)."""

    cfg: ModelConfig
    dtype: jnp.dtype
    plan: KernelPlan = KernelPlan()
    in_features: int = 0
    window: int = 0  # gpt-oss's sliding layers: keys a query sees (ModelConfig.window)

    def setup(self):
        c, plan = self.cfg, self.plan
        self.qkv_proj = Linear(c.q_size + 2 * c.kv_size, self.in_features or c.hidden_size, c.attention_bias,
                               self.dtype, plan)
        self.o_proj = Linear(c.hidden_size, c.q_size, c.attention_bias, self.dtype, plan)
        if c.qk_norm:
            self.q_norm = NormWeight(c.head_dim, self.dtype)
            self.k_norm = NormWeight(c.head_dim, self.dtype)
        if c.attention_sinks:  # gpt-oss: a logit per head in every softmax (ops.attention)
            self.sinks = param(self, "sinks", nn.initializers.zeros, (c.num_heads,), self.dtype)

    def qk_norms(self):  # Qwen3's per-head norm weights [D] ([None, None] without)
        return (self.q_norm.weight, self.k_norm.weight) if self.cfg.qk_norm else (None, None)

    def __call__(self, x, meta: AttentionMetadata, k_pages, v_pages, *, rope=None, residual=None, out_norm=None):
        """x: f[B, Q, in] or ops.Normed (the input norm, applied by the qkv projection);
        rope: (cos, sin) f32[B, Q, D/2] (None: from meta.positions); residual: f[B, Q, H],
        added to the output; out_norm: [H], the RMSNorm after the block: the output comes
        as ops.Normed(residual + o_proj(.), out_norm). -> (output, k_pages, v_pages)"""
        c, plan = self.cfg, self.plan
        B, Q, _ = x.shape
        qn, kn = self.qk_norms()
        rope = rope if rope is not None else rope_for(c.rope, c.head_dim, meta.positions)
        q, k_pages, v_pages = ops.qkv_rope_write(plan, x, self.qkv_proj.weight, self.qkv_proj.bias, rope,
                                                 meta.slot_mapping, k_pages, v_pages, qn, kn, num_heads=c.num_heads,
                                                 eps=c.rms_norm_eps)
        o = ops.attention(plan, q, k_pages, v_pages, meta, sm_scale=c.head_dim**-0.5,
                          sinks=self.sinks if c.attention_sinks else None, window=self.window).reshape(B, Q, c.q_size)
        if out_norm is None:
            return self.o_proj(o, residual=residual), k_pages, v_pages
        out = ops.linear_then_norm(plan, o, self.o_proj.weight, self.o_proj.bias, residual=residual, norm_w=out_norm,
                                   eps=c.rms_norm_eps)
        return out, k_pages, v_pages


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: h = x + attn(norm1(x)); out = h + mlp(norm2(h)). Each norm
    goes unapplied (ops.Normed) into the projection after it, and each residual add into the
    projection before it, so the ops may fuse them into their kernels. Under tensor
    parallelism (ops.layer_per_shard) the layer runs once per device: _layer_on_shard.
    A Transformer runs its layers through ``apply_layer``."""

    cfg: ModelConfig
    dtype: jnp.dtype
    plan: KernelPlan = KernelPlan()
    window: int = 0  # keys a query sees (gpt-oss's sliding layers: ModelConfig.window); 0: all
    moe: bool = False  # the MLP is experts (a Qwen3-MoE layer: ModelConfig.is_moe)

    def setup(self):
        c = self.cfg
        self.input_layernorm = NormWeight(c.hidden_size, self.dtype)
        self.post_attention_layernorm = NormWeight(c.hidden_size, self.dtype)
        self.attn = Attention(c, self.dtype, self.plan, window=self.window)
        if self.moe:
            self.mlp = MoE(c.hidden_size, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok,
                           c.norm_topk_prob, self.dtype, self.plan, c.moe_bias, c.swiglu_limit, c.swiglu_alpha, c.mxfp4)
        else:
            self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, c.mlp_bias, self.dtype, self.plan)

    def __call__(self, x, meta, k_pages, v_pages, rope=None, next_norm=None):
        """x: f[B, Q, H], or ops.Normed with this layer's input norm handed over by the layer
        before; next_norm: the weight [H] of the RMSNorm after this layer (the next layer's
        input norm), which the MLP may hand over (ops.mlp): the output then comes as Normed."""
        c = self.cfg
        if ops.layer_per_shard(self.plan, c.num_kv_heads):
            rope = rope if rope is not None else rope_for(c.rope, c.head_dim, meta.positions)
            return self._per_shard(x.x if isinstance(x, ops.Normed) else x, meta, k_pages, v_pages, rope)
        norm1, norm2 = self.input_layernorm.weight, self.post_attention_layernorm.weight
        x_normed = x if isinstance(x, ops.Normed) else ops.Normed(x, norm1, c.rms_norm_eps)
        h_normed, k_pages, v_pages = self.attn(x_normed, meta, k_pages, v_pages, rope=rope, residual=x_normed.x,
                                               out_norm=norm2)  # norm2(h), h = x + attn(norm1(x))
        nxt = None if next_norm is None else (next_norm, c.rms_norm_eps)
        return self.mlp(h_normed, residual=h_normed.x, next_norm=nxt), k_pages, v_pages

    def _per_shard(self, x, meta, k_pages, v_pages, rope):
        a, m = self.attn, self.mlp
        q_norm, k_norm = a.qk_norms()
        weights = dict(norm1=self.input_layernorm.weight, norm2=self.post_attention_layernorm.weight,
                       qkv=a.qkv_proj.weight, qkv_b=a.qkv_proj.bias, o=a.o_proj.weight, o_b=a.o_proj.bias,
                       q_norm=q_norm, k_norm=k_norm, gate_up=m.gate_up_proj.weight, gate_up_b=m.gate_up_proj.bias,
                       down=m.down_proj.weight, down_b=m.down_proj.bias)
        weights = {k: w for k, w in weights.items() if w is not None}
        splits = dict(qkv="out", qkv_b="out", o="in", gate_up="out", gate_up_b="out", down="in")
        fn = functools.partial(_layer_on_shard, self.cfg, ops.shard_plan(self.plan), self.plan.tp)
        return ops.per_shard_layer(self.plan, fn, weights, splits, x, meta, k_pages, v_pages, rope)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _apply_layer(c: ModelConfig, dtype, plan: KernelPlan, window: int, moe: bool, params, *args):
    return DecoderLayer(c, dtype, plan, window, moe, parent=None).apply({"params": params}, *args)


def apply_layer(layer: DecoderLayer, *args):
    """``layer(*args)`` as a call of one jitted function of the layer's kind (config, plan,
    window, experts) given the layer's parameters: jax traces it once for all the layers of
    a kind at a shape and lowers it once per program, a call that XLA inlines (the compiled
    program is the same). Unrolled, the 8B step's 32 layers were most of what warmup spends
    tracing and lowering on the server's main thread (docs/decisions.md). While parameters
    are being created (init) the layer is called as it is."""
    if layer.is_initializing():
        return layer(*args)
    return _apply_layer(layer.cfg, layer.dtype, layer.plan, layer.window, layer.moe, layer.variables["params"],
                        *args)


def next_input_norm(layers, i: int):
    """The input-norm weight [H] of ``layers[i + 1]``, which layers[i]'s MLP may hand over
    (``next_norm``); None after the last layer, whose output stays un-normed."""
    return layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None


def _layer_on_shard(c: ModelConfig, plan: KernelPlan, tp: int, w: dict, x, meta, k_pages, v_pages, rope):
    """One device's part of a decoder layer (Megatron): q/k/v of its heads (the q|k|v and
    gate|up weights are tp-interleaved, jspec/parallel/placement.py, so its block is
    [q_i | k_i | v_i]), attention over its KV heads, o_proj over its heads' columns, and
    its rows of gate|up and down. o_proj and down_proj give partial sums: all-reduced
    (ops.reduce_add) before each residual add. ``plan``: ops.shard_plan."""
    B, Q, _ = x.shape
    eps, f32 = c.rms_norm_eps, jnp.float32
    q, k_pages, v_pages = ops.qkv_rope_write(plan, ops.Normed(x, w["norm1"], eps), w["qkv"], w.get("qkv_b"), rope,
                                             meta.slot_mapping, k_pages, v_pages, w.get("q_norm"), w.get("k_norm"),
                                             num_heads=c.num_heads // tp, eps=eps)
    o = ops.attention(plan, q, k_pages, v_pages, meta, sm_scale=c.head_dim**-0.5).reshape(B, Q, -1)
    h = ops.reduce_add(ops.partial_linear(plan, o, w["o"]), x, w.get("o_b"))
    y = ops.mlp(plan, ops.Normed(h, w["norm2"], eps), w["gate_up"], w.get("gate_up_b"), w["down"], None, out_dtype=f32)
    return ops.reduce_add(y, h, w.get("down_b")), k_pages, v_pages


class Transformer(nn.Module):
    cfg: ModelConfig
    dtype: jnp.dtype = jnp.float32
    plan: KernelPlan = KernelPlan()

    def setup(self):
        c = self.cfg
        V = ops.vocab_rows(self.plan, c.vocab_size)  # padded under tensor parallelism: logits() slices it off
        self.embed_tokens = nn.Embed(V, c.hidden_size, dtype=self.dtype, param_dtype=self.dtype)
        self.layers = [DecoderLayer(c, self.dtype, self.plan, c.window(i), c.is_moe(i), name=f"layers_{i}")
                       for i in range(c.num_layers)]
        self.norm = RMSNorm(c.rms_norm_eps, self.dtype)
        if not c.tie_word_embeddings:
            # a bare [V, H] array so logits can accumulate in float32 (see logits()).
            self.lm_head = param(self, "lm_head", nn.initializers.normal(0.02),
                                 ops.weight_shape(self.plan, V, c.hidden_size), self.dtype)

    def __call__(
        self,
        tokens,  # i32[B, Q]
        meta: AttentionMetadata,
        kv: KVCache,
        aux_layers: tuple[int, ...] = (),  # canonical indices to capture, static
    ):  # -> (hidden f[B, Q, H] after the final norm, aux f[B, Q, len(aux), H] | None, KVCache)
        L = self.cfg.num_layers
        for c in aux_layers:
            if not 0 <= c <= L:
                raise ValueError(f"aux layer index {c} out of range [0, {L}] for a {L}-layer target")
        x = self.embed(tokens)
        captured = {}
        ks, vs = list(kv.k), list(kv.v)
        rope = rope_for(self.cfg.rope, self.cfg.head_dim, meta.positions)  # once for all layers
        stream = lambda x: x.x if isinstance(x, ops.Normed) else x  # noqa: E731  (a handed-over norm's input)
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                captured[i] = stream(x)
            x, ks[i], vs[i] = apply_layer(layer, x, meta, ks[i], vs[i], rope, next_input_norm(self.layers, i))
        if L in aux_layers:
            captured[L] = x
        aux = jnp.stack([captured[c] for c in aux_layers], axis=2) if aux_layers else None
        return self.norm(x), aux, KVCache(k=tuple(ks), v=tuple(vs))

    def embed(self, tokens):  # i32[...] -> [..., H]; the table split by vocabulary under tp
        return ops.embed(self.plan, self.embed_tokens.embedding, tokens, shards=self.plan.tp).astype(self.dtype)

    def embedding_table(self):
        """The input embedding [V, H] (the drafters that share the target's embed from it;
        V padded under tensor parallelism: ops.vocab_rows)."""
        return self.embed_tokens.embedding

    def lm_head_weight(self):
        """The output projection in the plan's weight layout (ops.weight_shape), for the
        DFlash drafter's logits. A tied embedding table is [V, H] in every plan: under
        in_out_weights its transpose, which XLA folds into the drafter's dot of block_size - 1
        rows."""
        if not self.cfg.tie_word_embeddings:
            return self.lm_head
        table = self.embed_tokens.embedding
        return table.T if self.plan.in_out_weights else table

    def logits(self, h):  # f[..., H] (already normed) -> f32[..., V] (the real vocabulary: ops.logits)
        V = self.cfg.vocab_size
        if self.cfg.tie_word_embeddings:  # the table, [V, H] in every plan
            return ops.logits(self.plan, h, self.embed_tokens.embedding, vocab_size=V, out_in=True)
        return ops.logits(self.plan, h, self.lm_head, vocab_size=V)
