"""A smaller LLM of the target's vocabulary as the drafter (vLLM's "draft_model", SGLang's
standalone drafter): e.g. Llama-3.2-1B drafting for Llama-3.1-8B. Its checkpoint is an
ordinary Llama / Qwen3 folder, loaded as a target is (jspec/checkpoint/target.py), and it
runs as ``Transformer`` over its own paged KV cache (the target's page ids, as every drafter).

Its KV at position p is built from the token at p (not p + 1, as EAGLE's), so the first pass
reads the step's own input tokens (``ProposeInputs.inputs``: the verified token and drafts,
or the prompt chunk) at their positions, with the target's metadata; then K single-token
steps start from the bonus token (the last pair's token, one position past the pair), each
writing its K/V and giving the next draft's logits.

Writes: the first pass to the step's own positions, the steps to K - 1 past the bonus
token's (``lookahead``: K + 1 past the step's last verified token).

Its registry entry: ``METHOD``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jspec.checkpoint.target import load_target
from jspec.config import ModelConfig
from jspec.drafters.config import DrafterConfig
from jspec.drafters.method import Method
from jspec.drafters.propose import create_kv_cache, gather_rows, no_drafts, pick, span_metadata
from jspec.kv_cache import KVCache
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


def load(spec, target: ModelConfig, dtype, sharding, load_format):
    """``Method.load``: load_draft_model of ``spec.model``."""
    return load_draft_model(spec.model, target, dtype, sharding, load_format=load_format)


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
    """(drafts i32[N, K], probs f32[N, K, V] | None, KVCache): the first pass over the step's
    own input tokens at their positions (the target's metadata, either layout), then K
    single-token steps from the bonus token (module docstring)."""
    model, variables = dm.model, {"params": params}
    meta = inp.meta
    P, S = kv.num_pages, kv.page_size
    _, _, kv = model.apply(variables, inp.inputs, meta, kv)  # KV of every verified position
    if not num_tokens:
        return no_drafts(inp.last_idx.shape[0], kv)
    bonus = gather_rows(inp.tokens, inp.last_idx)  # i32[N] the bonus token (the last pair's)
    pos = gather_rows(meta.positions, inp.last_idx) + 1  # i32[N] its position
    drafts, probs = [], []
    tok = bonus
    for j in range(num_tokens):
        step = span_metadata(meta.page_table, pos + j, 1, inp.active, S, P, causal=True)
        h, _, kv = model.apply(variables, tok[:, None], step, kv)
        logits = model.apply(variables, h[:, 0], method=Transformer.logits)  # f32[N, V]
        tok, p = pick(logits, inp.temperature, inp.seeds, pos + 1 + j, with_probs)  # key: the draft's position
        drafts.append(tok)
        probs.append(p)
    return jnp.stack(drafts, 1), (jnp.stack(probs, 1) if with_probs else None), kv


def lookahead(cfg: DrafterConfig, K: int) -> int:
    """K past the bonus token's position: K + 1 past the step's last verified token."""
    del cfg
    return K + 1


# Its KV at p is built from the token at p (not p + 1, as EAGLE's).
METHOD = Method(
    label="draft model", module=DraftModel, propose=draft_model_propose, lookahead=lookahead,
    reads_next_token=False, load=load, create_cache=create_kv_cache,
)
