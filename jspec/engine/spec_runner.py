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

Async scheduling: a verification step can start from the output of the step before it
while that one is still on the device (``prev``, its packed result): the host builds the
rows as they stood before ``prev`` and the device shifts each row by the count ``prev``
emitted and takes [bonus, next drafts] from it (``continue_from``). Same maths and RNG
keys as the unchained step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.drafters.config import DrafterConfig
from jspec.drafters.propose import ProposeInputs, slots_for
from jspec.drafters.registry import make_drafter
from jspec.engine.logits_processing import extend_history
from jspec.engine.logprobs import info_width
from jspec.engine.packing import pack
from jspec.engine.runner_base import RunnerBase, StepInput, StepShape
from jspec.engine.scheduler import ScheduledSeq, SchedulerOutput
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


def continue_from(inp: SpecInput, prev, K: int, page_size: int, num_pages: int) -> SpecInput:
    """The verification input of a step chained behind ``prev`` (i32[B, (K+1) + 1 + K], the
    previous step's packed output, still on the device). ``inp`` holds each row as it stood
    before ``prev`` (positions from its num_computed then, tokens -1, K drafts): ``prev``
    emitted n tokens, so the row moves n positions on and verifies [bonus, prev's drafts]."""
    b = inp.base
    active = b.q_lens > 0
    n_prev = jnp.where(active, prev[:, K + 1], 0)  # i32[B]
    bonus = jnp.take_along_axis(prev[:, : K + 1], jnp.maximum(n_prev - 1, 0)[:, None], axis=1)  # [B, 1]
    tokens = jnp.where(active[:, None], jnp.concatenate([bonus, prev[:, K + 2 : 2 * K + 2]], axis=1), 0)
    positions = b.meta.positions + n_prev[:, None]
    valid = jnp.arange(tokens.shape[1])[None, :] < b.q_lens[:, None]
    meta = b.meta.replace(
        positions=positions,
        slot_mapping=slots_for(b.meta.page_table, positions, valid, page_size, num_pages),
        kv_lens=jnp.where(active, b.meta.kv_lens + n_prev, 0),
    )
    proc = b.proc
    if proc is not None:  # the history as the host knew it lacks what prev emitted
        hist, n_hist = extend_history(proc.hist, proc.n_hist, prev[:, : K + 1], n_prev)
        proc = proc.replace(hist=hist, n_hist=n_hist)
    return inp.replace(base=b.replace(tokens=tokens, meta=meta, sample_pos=b.sample_pos + n_prev, proc=proc))


@dataclasses.dataclass
class SpecStepResult:
    tokens: np.ndarray  # i32[n, K+1]  emitted tokens, -1 padded
    num_emitted: np.ndarray  # i32[n]
    drafts: np.ndarray  # i32[n, K]    next proposals
    logprobs: np.ndarray | None = None  # i32[n, K+1, F] blocks of the emitted tokens (with processors)
    prompt_logprobs: np.ndarray | None = None  # i32[n, P, F] of each position's next prompt token


class SpecModelRunner(RunnerBase):
    def __init__(self, cfg, params, kv, buckets, *, dtype, plan: KernelPlan, spec: SpeculativeConfig,
                 dcfg: DrafterConfig, dparams, dkv, max_num_seqs: int):
        super().__init__(cfg, params, kv, buckets, dtype=dtype, plan=plan)
        self.spec = spec
        self.K = spec.num_speculative_tokens
        self.dcfg = dcfg
        self.dparams = dparams
        self.dkv = dkv
        self.drafter = make_drafter(dcfg, dtype=dtype, plan=plan.for_drafter())
        self.aux_layers = tuple(dcfg.aux_layer_ids)
        self.with_probs = spec.draft_sample_method == "probabilistic"
        V = cfg.vocab_size
        self.probs_buf = jnp.zeros((max_num_seqs, self.K, V), jnp.float32) if self.with_probs else None
        self._prob_rows: dict[str, int] = {}  # request id -> its row of probs_buf (assign_prob_rows)
        # A traced argument (not a constant): benchmarks swap rates without recompiling.
        self.synthetic_rates = (
            jnp.asarray(spec.synthetic_conditional_rates, jnp.float32)
            if spec.rejection_sample_method == "synthetic" else None
        )
        self._spec_step = jax.jit(self._spec_step_impl, static_argnames=("decode", "layout", "filtering"),
                                  donate_argnums=(2, 3, 4), compiler_options=self.plan.compiler_options)

    # ---- device side ------------------------------------------------------------------
    def _spec_step_impl(self, params, dparams, kv, dkv, probs_buf, synthetic_rates, ints, floats, prev=None, *,
                        decode, layout, filtering):
        self.num_compilations += 1
        inp: SpecInput = self._unpack(ints, floats, layout)
        if prev is not None:
            inp = continue_from(inp, prev, self.K, self.page_size, self.num_pages)
        b = inp.base
        h, aux, kv = self.model.apply({"params": params}, b.tokens, b.meta, kv, aux_layers=self.aux_layers)
        B, Q = b.tokens.shape
        lm = lambda x: self.model.apply({"params": params}, x, method=Transformer.logits)  # noqa: E731
        common = (b.temperature, b.top_k, b.top_p, b.seeds, b.sample_pos)
        if decode:
            q = probs_buf[inp.prob_rows] if self.with_probs else None
            # Position j sees the drafts before it (logits_processing: penalties, bad words...).
            logits, raw = self._process(lm(h), b, b.proc, b.tokens[:, 1:])
            out, n_emit = rejection_sample(
                logits, b.tokens[:, 1:], inp.num_draft, q, *common,
                method=self.spec.rejection_sample_method, synthetic_rates=synthetic_rates,
                impl=self.sample_impl, filtering=filtering,
            )
            pairs = jnp.maximum(out, 0)  # [B, K+1] == [B, Q]
            last_idx = n_emit - 1
        else:
            last_idx = jnp.maximum(b.q_lens - 1, 0)
            last_h = h[jnp.arange(B), last_idx]
            logits, raw = self._process(lm(last_h)[:, None], b, b.proc, jnp.zeros((B, 0), jnp.int32))
            out, n_emit = rejection_sample(
                logits, jnp.zeros((B, 0), jnp.int32), jnp.zeros((B,), jnp.int32), None, *common,
                impl=self.sample_impl, filtering=filtering,
            )
            sampled = out[:, 0]
            at_last = jnp.arange(Q)[None, :] == last_idx[:, None]
            pairs = jnp.where(at_last & inp.sample[:, None], sampled[:, None], inp.pair_next)
        aux = aux.reshape(B, Q, -1)
        draft_temp = b.temperature if self.with_probs else jnp.zeros_like(b.temperature)
        embed, lm_head = self.embedding_table(params), self.lm_head_weight(params)
        drafts, probs, dkv = self.drafter.propose(
            dparams, dkv, ProposeInputs(pairs, aux, b.meta, last_idx, embed, lm_head, b.seeds, draft_temp, inp.sample),
            num_tokens=self.K, with_probs=self.with_probs,
        )
        if self.with_probs:
            rows = jnp.where(inp.sample, inp.prob_rows, probs_buf.shape[0])  # padding rows: dropped
            probs_buf = probs_buf.at[rows].set(probs[:, : self.K], mode="drop")  # DFlash may draft > K
        # One int32 block [B, (K+1) + 1 + K]: a single device->host read per step.
        # A prefill step emits one token: padded to K + 1 so read_spec finds the drafts.
        out = jnp.pad(out, ((0, 0), (0, self.K + 1 - out.shape[1])), constant_values=-1)
        parts = [out, n_emit[:, None], drafts[:, : self.K].astype(jnp.int32)]
        if b.proc is not None:  # logprob blocks of the emitted tokens ride along: still one read
            lp = self._token_logprobs(raw, logits, out[:, : logits.shape[1]], b)  # [B, 1 or K+1, F]
            lp = jnp.pad(lp, ((0, 0), (0, self.K + 1 - lp.shape[1]), (0, 0)))
            parts += [lp.reshape(B, -1), self._prompt_logprobs(params, h, b.proc).reshape(B, -1)]
        packed = jnp.concatenate(parts, axis=1)
        return kv, dkv, probs_buf, packed

    # ---- host side --------------------------------------------------------------------
    def build_spec_input(self, sched: SchedulerOutput, chained: bool = False) -> tuple[SpecInput, int, bool]:
        """The step's input from the host state. ``chained``: for a verification step that
        continues one still on the device (``continue_from``): every row verifies K drafts,
        tokens and the position shift come from that step."""
        decode = sched.kind == "decode"
        if chained:
            sched = SchedulerOutput("decode", [ScheduledSeq(r.seq, self.K + 1, True) for r in sched.seqs], [])
        base, n = self.build_input(sched, self.K + 1 if decode else self.chunk_q(sched), tokens_on_device=chained)
        B, Q = base.tokens.shape
        num_draft = np.zeros((B,), np.int32)
        pair_next = np.zeros((B, Q), np.int32)
        sample = np.zeros((B,), bool)
        rows = np.zeros((B,), np.int32)
        for i, r in enumerate(sched.seqs):
            s = r.seq
            sample[i] = r.sample
            rows[i] = self._prob_rows.get(s.request_id, 0)
            if decode:
                num_draft[i] = self.K if chained else len(s.draft_token_ids)
            else:
                nxt = s.tokens_between(s.num_computed + 1, s.num_computed + 1 + r.num_new)
                pair_next[i, : len(nxt)] = nxt
        return SpecInput(base, num_draft, pair_next, sample, rows), n, decode

    def run_spec(self, inp: SpecInput, decode: bool, prev: jax.Array | None = None) -> jax.Array:
        """One jitted speculative step on a host-built input, returned without waiting for
        the device: i32[B, (K+1) + 1 + K] = emitted tokens | count | next drafts. With
        ``prev`` (such an output, not yet read) the step continues that one."""
        ints, floats, layout = pack(inp)
        self.kv, self.dkv, self.probs_buf, packed = self._spec_step(
            self.params, self.dparams, self.kv, self.dkv, self.probs_buf, self.synthetic_rates, ints, floats, prev,
            decode=decode, layout=self._layout_id(layout), filtering=self._filtering(inp.base),
        )
        return packed

    def assign_prob_rows(self, sched: SchedulerOutput, running: set):
        """Rows of probs_buf for the scheduled requests: a request keeps its row while it is
        ``running`` (ids), whose drafts' probabilities the row holds between steps."""
        if not self.with_probs:
            return
        rows = self._prob_rows
        for rid in [r for r in rows if r not in running]:
            del rows[rid]
        free = sorted(set(range(self.probs_buf.shape[0])) - set(rows.values()))
        for r in sched.seqs:
            if r.seq.request_id not in rows:
                rows[r.seq.request_id] = free.pop(0)

    def dispatch_spec(self, sched: SchedulerOutput, running: set, prev: jax.Array | None = None) -> jax.Array:
        """Start a speculative step (chained behind ``prev`` when given); its packed output
        stays on the device until ``read_spec``."""
        if prev is None:  # a chained step keeps the rows of the step it continues
            self.assign_prob_rows(sched, running)
        inp, _, decode = self.build_spec_input(sched, chained=prev is not None)
        return self.run_spec(inp, decode, prev)

    def read_spec(self, packed: jax.Array, n: int) -> SpecStepResult:
        """Wait for a step's packed output and split its first n rows."""
        packed = np.asarray(packed)[:n]
        K1 = self.K + 1
        res = SpecStepResult(packed[:, :K1], packed[:, K1], packed[:, K1 + 1 : 2 * K1])
        if packed.shape[1] > 2 * K1:  # with processors: logprob blocks, then prompt logprob blocks
            F = info_width(self.n_top_logprobs)
            res.logprobs = packed[:, 2 * K1 : 2 * K1 + K1 * F].reshape(n, K1, F)
            res.prompt_logprobs = packed[:, 2 * K1 + K1 * F :].reshape(n, -1, F)
        return res

    def execute_spec(self, sched: SchedulerOutput, running: set) -> SpecStepResult:
        return self.read_spec(self.dispatch_spec(sched, running), len(sched.seqs))

    def warmup_shapes(self, num_scheduler_steps: int = 1, async_scheduling: bool = False) -> list[StepShape]:
        """Every shape the speculative step compiles for: verification (Q = K + 1), with
        async scheduling also its chained form (steps = 1: continues a step on the device),
        and the prefill chunk buckets, for each batch and page-table bucket.
        (num_scheduler_steps does not apply to speculation.)"""
        qs = [(self.K + 1, 0, True)] + ([(self.K + 1, 1, True)] if async_scheduling else [])
        qs += [(Q, 0, False) for Q in self.buckets.prefill_q]
        return [StepShape(B, Q, W, steps, decode) for B in self.buckets.batch for Q, steps, decode in qs
                for W in self.buckets.pages]

    def empty_spec_input(self, sh: StepShape) -> SpecInput:
        """A step of shape ``sh`` with no active row: nothing samples, drafts or writes."""
        B, Q = sh.batch, sh.q
        zeros = np.zeros((B,), np.int32)
        return SpecInput(self.empty_input(B, Q, sh.pages), zeros, np.zeros((B, Q), np.int32), np.zeros((B,), bool),
                         zeros)

    def _empty_prev(self, sh: StepShape):
        """A stand-in ``prev`` for compiling the chained form (steps = 1), else None."""
        return jnp.zeros((sh.batch, 2 * self.K + 2), jnp.int32) if sh.steps else None

    def lower_spec(self, sh: StepShape):
        """The speculative step of shape ``sh``, lowered (not run): ``.compile()`` gives its
        executable and ``memory_analysis()`` (tests check it needs no cache-sized copies)."""
        inp = self.empty_spec_input(sh)
        ints, floats, layout = pack(inp)
        return self._spec_step.lower(
            self.params, self.dparams, self.kv, self.dkv, self.probs_buf, self.synthetic_rates, ints, floats,
            self._empty_prev(sh), decode=sh.decode, layout=self._layout_id(layout),
            filtering=self._filtering(inp.base),
        )

    def warmup(self, num_scheduler_steps: int = 1, async_scheduling: bool = False, shapes=None):
        """Compile every shape (or ``shapes``, a subset of ``warmup_shapes``) with empty rows:
        no row samples or drafts, every target and drafter write is dropped, so the caches
        and the draft-probability buffer keep their contents."""
        for sh in shapes or self.warmup_shapes(num_scheduler_steps, async_scheduling):
            self.run_spec(self.empty_spec_input(sh), sh.decode, self._empty_prev(sh))
        jax.block_until_ready((self.kv, self.dkv))
