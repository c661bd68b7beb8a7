"""The n-gram method (vLLM's "ngram", prompt lookup decoding): no model, the drafts are the
tokens that followed an earlier occurrence of the sequence's last n tokens. Its config,
cache, proposal and registry entry (``METHOD``).

vLLM's rule (its NgramProposer): the longest n in [prompt_lookup_min, prompt_lookup_max]
for which the last n tokens occurred before, at the earliest such occurrence; the drafts
are the K tokens after it. vLLM proposes fewer than K where the sequence ends first and
none without a match; the engine's step verifies K drafts for every row, so here

  - the drafts past the sequence's end continue with the period of the match (the tokens
    after the match again: what the matched text predicts once its own continuation is
    drafted), and
  - a row without a match drafts its last token K times.

Either way the output distribution is the target's (rejection sampling is lossless for
any draft); only acceptance depends on the choice.

It runs inside the step's one device program, so async chaining stays: the history is a
cache like the other drafters' KV, paged with the target's page ids (``TokenHistory``).
Like EAGLE's KV it is written from the step's pairs: the slot of position p holds the
token at p + 1 (``ProposeInputs.tokens``). The history of a row whose last pair is at
position l is x_1 .. x_{l+1}: the sequence without its first token, which only a match
starting at x_0 would need (vLLM's can).

Cost per step: B rows x (W pages x S slots) x prompt_lookup_max integer compares over the
gathered history, and the gather itself (4 bytes a slot): small beside a target forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec

from jspec.config import ModelConfig
from jspec.drafters.config import DrafterConfig, layerless_config
from jspec.drafters.method import Method
from jspec.drafters.propose import gather_rows, no_drafts


@struct.dataclass
class TokenHistory:
    """The n-gram drafter's cache: i32[P, S], at the slot of position p the token at p + 1."""

    tokens: jax.Array

    @classmethod
    def create(cls, num_pages: int, page_size: int, sharding=None):
        if isinstance(sharding, NamedSharding):  # the KV's sharding is by head; token ids are replicated
            sharding = NamedSharding(sharding.mesh, PartitionSpec())
        return cls(jnp.zeros((num_pages, page_size), jnp.int32, device=sharding))

    @property
    def num_pages(self) -> int:
        return self.tokens.shape[0]

    @property
    def page_size(self) -> int:
        return self.tokens.shape[1]


def ngram_config(target: ModelConfig, lookup_min: int, lookup_max: int) -> DrafterConfig:
    """The DrafterConfig of the n-gram method on ``target``: no layers, no aux states."""
    return layerless_config("ngram", target, prompt_lookup_min=lookup_min, prompt_lookup_max=lookup_max)


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    """The registry's "module" of the n-gram method: its config, static under jit."""

    cfg: DrafterConfig
    dtype: Any = dataclasses.field(default=None, compare=False)  # make_drafter's keywords: unused
    plan: Any = dataclasses.field(default=None, compare=False)


def ngram_propose(proposer: NgramProposer, params, cache: TokenHistory, inp, *, num_tokens: int,
                  with_probs: bool = False):
    """(drafts i32[B, K], probs f32[B, K, V] one-hot | None, TokenHistory): the pairs written,
    then the match over each row's history (module docstring). ``params`` is unused (none)."""
    del params
    c = proposer.cfg
    P, S = cache.tokens.shape
    flat = cache.tokens.reshape(-1).at[inp.meta.slot_mapping.reshape(-1)].set(inp.tokens.reshape(-1), mode="drop")
    if not num_tokens:
        return no_drafts(inp.last_idx.shape[0], TokenHistory(flat.reshape(cache.tokens.shape)))
    B = inp.last_idx.shape[0]
    pages = jnp.clip(inp.meta.page_table, 0, P - 1)  # [B, W]; entries past a row's pages are masked below
    hist = flat.reshape(P, S)[pages].reshape(B, -1)  # i32[B, N]: history slot i = the token at i + 1
    N = hist.shape[1]
    last = gather_rows(inp.meta.positions, inp.last_idx)  # position of the last pair
    length = jnp.clip(last + 1, 1, N)  # i32[B] history entries
    idx = jnp.arange(N, dtype=jnp.int32)
    # run[b, j]: the last t + 1 entries end at j too (j - u matches length - 1 - u for u <= t)
    run = jnp.ones((B, N), bool)
    match_len = jnp.zeros((B, N), jnp.int32)
    for t in range(c.prompt_lookup_max):
        suffix_t = jnp.take_along_axis(hist, jnp.maximum(length - 1 - t, 0)[:, None], axis=1)  # [B, 1]
        shifted = jnp.pad(hist, ((0, 0), (t, 0)), constant_values=-1)[:, :N]  # shifted[b, j] = hist[b, j - t]
        run = run & (shifted == suffix_t) & (t < length)[:, None]
        match_len = match_len + run
    match_len = jnp.where(idx[None, :] < (length - 1)[:, None], match_len, 0)  # strictly before the suffix
    end = jnp.argmax(match_len, axis=1).astype(jnp.int32)  # the earliest of the longest
    found = jnp.take_along_axis(match_len, end[:, None], axis=1)[:, 0] >= c.prompt_lookup_min
    end = jnp.where(found, end, length - 2)  # no match: period 1 from the last token
    period = jnp.maximum(length - 1 - end, 1)
    src = end[:, None] + 1 + jnp.arange(num_tokens, dtype=jnp.int32)[None, :] % period[:, None]
    drafts = jnp.take_along_axis(hist, jnp.clip(src, 0, N - 1), axis=1)
    probs = jax.nn.one_hot(drafts, c.target_vocab_size, dtype=jnp.float32) if with_probs else None
    return drafts, probs, TokenHistory(flat.reshape(P, S))


def load(spec, target: ModelConfig, dtype, sharding, load_format):
    """``Method.load``: the config of speculative_config's n-gram lengths; no weights (it
    drafts from the sequence's own tokens)."""
    del dtype, sharding, load_format
    return ngram_config(target, spec.prompt_lookup_min, spec.prompt_lookup_max), {}


def create_cache(cfg: DrafterConfig, num_pages: int, page_size: int, dtype, sharding=None) -> TokenHistory:
    """``Method.create_cache``: the token history i32[P, S] (its dtype is the token ids')."""
    del cfg, dtype
    return TokenHistory.create(num_pages, page_size, sharding)


def lookahead(cfg: DrafterConfig, K: int) -> int:
    """0: the history is written at the verified pairs' own slots only."""
    del cfg, K
    return 0


# The history at p holds the token at p + 1, as EAGLE's KV is built from it.
METHOD = Method(
    label="n-gram", module=NgramProposer, propose=ngram_propose, lookahead=lookahead, reads_next_token=True,
    load=load, create_cache=create_cache, needs_model=False,
)
