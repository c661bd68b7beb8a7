"""The speculative step: verify, rejection-sample and propose the next drafts in ONE jit.

Device data flow of a decode (verify) step, Q = K + 1 per row:
  tokens [last, d_1..d_n, pad]  --target-->  logits [B, Q, V] + aux states [B, Q, n*H]
  rejection_sample(logits, drafts, q)  -->  out [B, K+1] (-1 padded), n_emit [B]
  pairs (out[i], aux[i]) for i < n_emit  --drafter-->  next drafts [B, K] (+ q [B, K, V])
A prefill step (Q = chunk bucket) samples one token at each row's last prompt position
and feeds the drafter the shifted prompt (the pair tokens come from the host) with the
sampled token as the last pair, so the first drafts exist as soon as the prompt is done.

Draft probabilities (draft_sample_method="probabilistic") stay on the device between
steps in ``probs_buf: f32[max_num_seqs, K, V]``, one row per running request.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.drafters import DFlashDrafter, Eagle3Drafter
from jspec.drafters.config import DrafterConfig
from jspec.drafters.propose import dflash_propose, eagle3_propose, peagle_propose
from jspec.engine.packing import pack
from jspec.engine.runner import ModelRunner, StepInput, StepShape
from jspec.engine.scheduler import SchedulerOutput
from jspec.models.transformer import Transformer
from jspec.ops import KernelPlan
from jspec.speculative_config import SpeculativeConfig
from kernels_pallas.rejection_sampling import rejection_sample


@struct.dataclass
class SpecInput:
    base: StepInput
    num_draft: jax.Array  # i32[B]     drafts carried in tokens[:, 1:] (decode steps)
    pair_next: jax.Array  # i32[B, Q]  token at position + 1, known on the host (prefill steps)
    sample: jax.Array  # bool[B]       rows that reach their last token (sample + propose)
    prob_rows: jax.Array  # i32[B]     row of each request in probs_buf (padding: 0, unused)


@dataclasses.dataclass
class SpecStepResult:
    tokens: np.ndarray  # i32[n, K+1]  emitted tokens, -1 padded
    num_emitted: np.ndarray  # i32[n]
    drafts: np.ndarray  # i32[n, K]    next proposals


class SpecModelRunner(ModelRunner):
    def __init__(self, cfg, params, kv, buckets, *, dtype, plan: KernelPlan, spec: SpeculativeConfig,
                 dcfg: DrafterConfig, dparams, dkv, max_num_seqs: int):
        super().__init__(cfg, params, kv, buckets, dtype=dtype, plan=plan)
        self.spec = spec
        self.K = spec.num_speculative_tokens
        self.dcfg = dcfg
        self.dparams = dparams
        self.dkv = dkv
        cls = DFlashDrafter if dcfg.method == "dflash" else Eagle3Drafter
        self.drafter = cls(dcfg, dtype=dtype, plan=plan.for_drafter())
        self.aux_layers = tuple(dcfg.aux_layer_ids)
        self.with_probs = spec.draft_sample_method == "probabilistic"
        V = cfg.vocab_size
        self.probs_buf = jnp.zeros((max_num_seqs, self.K, V), jnp.float32) if self.with_probs else None
        # A traced argument (not a constant): benchmarks swap rates without recompiling.
        self.synthetic_rates = (
            jnp.asarray(spec.synthetic_conditional_rates, jnp.float32)
            if spec.rejection_sample_method == "synthetic" else None
        )
        self._spec_step = jax.jit(self._spec_step_impl, static_argnames=("decode", "layout", "filtering"),
                                  donate_argnums=(2, 3, 4))

    # ---- device side ------------------------------------------------------------------
    def _spec_step_impl(self, params, dparams, kv, dkv, probs_buf, synthetic_rates, ints, floats, *, decode, layout,
                        filtering):
        self.num_compilations += 1
        inp: SpecInput = self._unpack(ints, floats, layout)
        b = inp.base
        h, aux, kv = self.model.apply({"params": params}, b.tokens, b.meta, kv, aux_layers=self.aux_layers)
        B, Q = b.tokens.shape
        lm = lambda x: self.model.apply({"params": params}, x, method=Transformer.logits)  # noqa: E731
        common = (b.temperature, b.top_k, b.top_p, b.seeds, b.sample_pos)
        if decode:
            q = probs_buf[inp.prob_rows] if self.with_probs else None
            out, n_emit = rejection_sample(
                lm(h), b.tokens[:, 1:], inp.num_draft, q, *common,
                method=self.spec.rejection_sample_method, synthetic_rates=synthetic_rates,
                impl=self.sample_impl, filtering=filtering,
            )
            pairs = jnp.maximum(out, 0)  # [B, K+1] == [B, Q]
            last_idx = n_emit - 1
        else:
            last_idx = jnp.maximum(b.q_lens - 1, 0)
            last_h = h[jnp.arange(B), last_idx]
            out, n_emit = rejection_sample(
                lm(last_h)[:, None], jnp.zeros((B, 0), jnp.int32), jnp.zeros((B,), jnp.int32), None, *common,
                impl=self.sample_impl, filtering=filtering,
            )
            sampled = out[:, 0]
            at_last = jnp.arange(Q)[None, :] == last_idx[:, None]
            pairs = jnp.where(at_last & inp.sample[:, None], sampled[:, None], inp.pair_next)
        aux = aux.reshape(B, Q, -1)
        draft_temp = b.temperature if self.with_probs else jnp.zeros_like(b.temperature)
        embed = params["embed_tokens"]["embedding"]
        if self.dcfg.method == "dflash":
            lm_head = embed if self.cfg.tie_word_embeddings else params["lm_head"]
            bonus = pairs[jnp.arange(B), last_idx]
            drafts, probs, dkv = dflash_propose(
                self.drafter, dparams, dkv, bonus, aux, b.meta, last_idx, embed, lm_head, b.seeds, draft_temp,
                inp.sample, with_probs=self.with_probs,
            )
        else:
            fn = peagle_propose if self.dcfg.method == "peagle" else eagle3_propose
            drafts, probs, dkv = fn(
                self.drafter, dparams, dkv, pairs, aux, b.meta, last_idx,
                None if self.dcfg.has_own_embeddings else embed, b.seeds, draft_temp, inp.sample,
                num_tokens=self.K, with_probs=self.with_probs,
            )
        if self.with_probs:
            rows = jnp.where(inp.sample, inp.prob_rows, probs_buf.shape[0])  # padding rows: dropped
            probs_buf = probs_buf.at[rows].set(probs[:, : self.K], mode="drop")  # DFlash may draft > K
        # One int32 block [B, (K+1) + 1 + K]: a single device->host read per step.
        packed = jnp.concatenate([out, n_emit[:, None], drafts[:, : self.K].astype(jnp.int32)], axis=1)
        return kv, dkv, probs_buf, packed

    # ---- host side --------------------------------------------------------------------
    def build_spec_input(self, sched: SchedulerOutput, prob_rows: dict) -> tuple[SpecInput, int, bool]:
        decode = sched.kind == "decode"
        base, n = self.build_input(sched, q_override=self.K + 1 if decode else None)
        B, Q = base.tokens.shape
        num_draft = np.zeros((B,), np.int32)
        pair_next = np.zeros((B, Q), np.int32)
        sample = np.zeros((B,), bool)
        rows = np.zeros((B,), np.int32)
        for i, r in enumerate(sched.seqs):
            s = r.seq
            sample[i] = r.sample
            rows[i] = prob_rows.get(s.request_id, 0)
            if decode:
                num_draft[i] = len(s.draft_token_ids)
            else:
                nxt = s.tokens_between(s.num_computed + 1, s.num_computed + 1 + r.num_new)
                pair_next[i, : len(nxt)] = nxt
        return SpecInput(base, num_draft, pair_next, sample, rows), n, decode

    def run_spec(self, inp: SpecInput, decode: bool) -> jax.Array:
        """One jitted speculative step on a host-built input, returned without waiting for
        the device: i32[B, (K+1) + 1 + K] = emitted tokens | count | next drafts."""
        ints, floats, layout = pack(inp)
        self.kv, self.dkv, self.probs_buf, packed = self._spec_step(
            self.params, self.dparams, self.kv, self.dkv, self.probs_buf, self.synthetic_rates, ints, floats,
            decode=decode, layout=self._layout_id(layout), filtering=self._filtering(inp.base),
        )
        return packed

    def execute_spec(self, sched: SchedulerOutput, prob_rows: dict) -> SpecStepResult:
        inp, n, decode = self.build_spec_input(sched, prob_rows)
        packed = np.asarray(self.run_spec(inp, decode))[:n]
        K1 = self.K + 1
        return SpecStepResult(packed[:, :K1], packed[:, K1], packed[:, K1 + 1 :])

    def warmup_shapes(self, num_scheduler_steps: int = 1, async_scheduling: bool = False) -> list[StepShape]:
        """Every shape the speculative step compiles for: verification (Q = K + 1) and the
        prefill chunk buckets, for each batch and page-table bucket. (Speculation has no
        multi-step or fed-back calls: the arguments are the plain runner's, ignored.)"""
        qs = [(self.K + 1, True)] + [(Q, False) for Q in self.buckets.prefill_q]
        return [StepShape(B, Q, W, 0, decode) for B in self.buckets.batch for Q, decode in qs
                for W in self.buckets.pages]

    def empty_spec_input(self, sh: StepShape) -> SpecInput:
        """A step of shape ``sh`` with no active row: nothing samples, drafts or writes."""
        B, Q = sh.batch, sh.q
        zeros = np.zeros((B,), np.int32)
        return SpecInput(self.empty_input(B, Q, sh.pages), zeros, np.zeros((B, Q), np.int32), np.zeros((B,), bool),
                         zeros)

    def lower_spec(self, sh: StepShape):
        """The speculative step of shape ``sh``, lowered (not run): ``.compile()`` gives its
        executable and ``memory_analysis()`` (tests check it needs no cache-sized copies)."""
        inp = self.empty_spec_input(sh)
        ints, floats, layout = pack(inp)
        return self._spec_step.lower(
            self.params, self.dparams, self.kv, self.dkv, self.probs_buf, self.synthetic_rates, ints, floats,
            decode=sh.decode, layout=self._layout_id(layout), filtering=self._filtering(inp.base),
        )

    def warmup(self, num_scheduler_steps: int = 1, async_scheduling: bool = False, shapes=None):
        """Compile every shape (or ``shapes``, a subset of ``warmup_shapes``) with empty rows:
        no row samples or drafts, every target and drafter write is dropped, so the caches
        and the draft-probability buffer keep their contents."""
        for sh in shapes or self.warmup_shapes():
            self.run_spec(self.empty_spec_input(sh), sh.decode)
        jax.block_until_ready((self.kv, self.dkv))
