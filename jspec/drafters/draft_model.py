"""A smaller LLM of the target's vocabulary as the drafter (vLLM's "draft_model", SGLang's
standalone drafter): e.g. Llama-3.2-1B drafting for Llama-3.1-8B. Its checkpoint is an
ordinary Llama / Qwen3 folder, loaded as a target is (jspec/checkpoint/target.py), and it
runs as ``Transformer`` over its own paged KV cache (the target's page ids, as every drafter).

Its KV at position p is built from the token at p (not p + 1, as EAGLE's), so the first pass
reads the step's first token at its position s and then the pairs one position on: the
tokens at s .. s + Q (``ProposeInputs.first``, then ``tokens``). The bonus token sits at
index last_idx + 1; its logits give d_1, and K - 1 single-token steps feed each draft back.

Writes: the first pass to one position past the step's last token, the steps to K past the
bonus pair (``lookahead``: K + 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jspec.checkpoint.target import load_target
from jspec.config import ModelConfig
from jspec.drafters.config import DrafterConfig
from jspec.drafters.propose import _gather_rows, _pick, slots_for, span_metadata
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.transformer import Transformer
from jspec.ops import KernelPlan


def draft_model_config(model: ModelConfig, target: ModelConfig, path: str = "") -> DrafterConfig:
    """The DrafterConfig of draft model ``model`` for ``target``; a ValueError unless they
    share the vocabulary (the drafts are target token ids)."""
    if model.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config 'model' {path!r}: a draft model must share the target's vocabulary, but its "
            f"vocab_size is {model.vocab_size} and the target's {target.vocab_size}")
    return DrafterConfig(
        method="draft_model", source_format="hf", family=model.family, hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size, num_layers=model.num_layers, num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, rms_norm_eps=model.rms_norm_eps, rope=model.rope,
        draft_vocab_size=model.vocab_size, target_vocab_size=target.vocab_size,
        target_hidden_size=target.hidden_size, aux_layer_ids=(), norm_before_residual=False, norm_before_fc=False,
        has_own_embeddings=True, has_d2t=False, mask_token_id=None, block_size=None, num_speculative_tokens=None,
        qk_norm=model.qk_norm, attention_bias=model.attention_bias, mlp_bias=model.mlp_bias,
        max_position_embeddings=model.max_position_embeddings, draft_model=model,
    )


def load_draft_model(path, target: ModelConfig, dtype="float32", sharding=None, load_format="auto"):
    """(DrafterConfig, params) of the draft model at ``path`` (a Llama / Qwen3 folder)."""
    cfg, params = load_target(path, dtype, sharding, load_format=load_format)
    return draft_model_config(cfg, target, str(path)), params


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """The registry's module of the method: its config; the model is jspec's Transformer."""

    cfg: DrafterConfig
    dtype: Any = jnp.float32
    plan: KernelPlan = KernelPlan()

    @property
    def model(self) -> Transformer:
        return Transformer(self.cfg.draft_model, self.dtype, self.plan)


def draft_model_propose(dm: DraftModel, params, kv: KVCache, inp, *, num_tokens: int, with_probs: bool = False):
    """(drafts i32[B, K], probs f32[B, K, V] | None, KVCache): the first pass over the step's
    first token and the shifted pairs, then K - 1 single-token steps (module docstring)."""
    model, variables = dm.model, {"params": params}
    meta = inp.meta
    P, S = kv.num_pages, kv.page_size
    valid = meta.slot_mapping < P * S  # the step's real entries; each pair moves one on with its entry
    positions = jnp.concatenate([meta.positions[:, :1], meta.positions + 1], axis=1)  # [B, Q + 1]
    first = AttentionMetadata(
        page_table=meta.page_table,
        kv_lens=jnp.where(meta.kv_lens > 0, meta.kv_lens + 1, 0).astype(jnp.int32),
        positions=positions,
        slot_mapping=slots_for(meta.page_table, positions, jnp.concatenate([valid[:, :1], valid], 1), S, P),
        causal=meta.causal,
    )
    tokens = jnp.concatenate([inp.first[:, None], inp.tokens], axis=1)
    h, _, kv = model.apply(variables, tokens, first, kv)
    h = _gather_rows(h, inp.last_idx + 1)  # [B, H] at the bonus token
    pos = _gather_rows(positions, inp.last_idx + 1)  # i32[B] the bonus token's position
    drafts, probs = [], []
    for j in range(num_tokens):
        logits = model.apply(variables, h, method=Transformer.logits)  # f32[B, V]
        ids, p = _pick(logits, inp.temperature, inp.seeds, pos + 1 + j, with_probs)  # key: the draft's position
        drafts.append(ids)
        probs.append(p)
        if j + 1 < num_tokens:
            step = span_metadata(meta.page_table, pos + 1 + j, 1, inp.active, S, P, causal=True)
            h, _, kv = model.apply(variables, ids[:, None], step, kv)
            h = h[:, 0]
    return jnp.stack(drafts, 1), (jnp.stack(probs, 1) if with_probs else None), kv
