"""The speculative step: verify, rejection-sample and propose the next drafts in ONE jit.

Device data flow of a decode (verify) step, Q = K + 1 per row:
  tokens [last, d_1..d_n, pad]  --target-->  logits [B, Q, V] + aux states [B, Q, n*H]
  rejection_sample(logits, drafts, q)  -->  out [B, K+1] (-1 padded), n_emit [B]
  pairs (out[i], aux[i]) for i < n_emit  --drafter-->  next drafts [B, K] (+ q [B, K, V])
A prefill step (Q = chunk bucket) samples one token at each row's last prompt position
and feeds the drafter the shifted prompt (the pair tokens come from the host) with the
sampled token as the last pair, so the first drafts exist as soon as the prompt is done.
A mixed step runs both in one call, over one target forward (spec_mixed.py).

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
from jspec.engine.runner_base import RunnerBase, SampleInput, Split, StepInput, StepShape
from jspec.engine.scheduler import ScheduledSeq, SchedulerOutput
from jspec.engine.spec_mixed import SpecMixedSteps, mixed_shapes
from jspec.models.transformer import Transformer
from jspec.ops import KernelPlan
from jspec.parallel import replicate
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


def last_positions(b: StepInput) -> jax.Array:
    """i32[B]: index along Q of each row's last token (0 for empty rows)."""
    return jnp.maximum(b.q_lens - 1, 0)


@dataclasses.dataclass
class SpecStepResult:
    tokens: np.ndarray  # i32[n, K+1]  emitted tokens, -1 padded
    num_emitted: np.ndarray  # i32[n]
    drafts: np.ndarray  # i32[n, K]    next proposals
    logprobs: np.ndarray | None = None  # i32[n, K+1, F] blocks of the emitted tokens (with processors)
    prompt_logprobs: np.ndarray | None = None  # i32[n, P, F] of each position's next prompt token


class SpecModelRunner(SpecMixedSteps, RunnerBase):
    def __init__(self, cfg, params, kv, buckets, *, dtype, plan: KernelPlan, spec: SpeculativeConfig,
                 dcfg: DrafterConfig, dparams, dkv, max_num_seqs: int):
        super().__init__(cfg, params, kv, buckets, dtype=dtype, plan=plan)
        self.spec = spec
        self.K = spec.num_speculative_tokens
        self.dcfg = dcfg
        self.dparams = dparams
        self.dkv = dkv
        self.drafter = make_drafter(dcfg, dtype=dtype, plan=plan)
        self.aux_layers = tuple(dcfg.aux_layer_ids)
        self.with_probs = spec.draft_sample_method == "probabilistic"
        V = cfg.vocab_size
        self.probs_buf = (replicate(jnp.zeros((max_num_seqs, self.K, V), jnp.float32), plan.mesh)
                          if self.with_probs else None)
        self._prob_rows: dict[str, int] = {}  # request id -> its row of probs_buf (assign_prob_rows)
        # A traced argument (not a constant): benchmarks swap rates without recompiling.
        self.synthetic_rates = (
            jnp.asarray(spec.synthetic_conditional_rates, jnp.float32)
            if spec.rejection_sample_method == "synthetic" else None
        )
        self._spec_step = jax.jit(self._spec_step_impl, static_argnames=("decode", "layout", "filtering"),
                                  donate_argnums=(2, 3, 4), compiler_options=self.plan.compiler_options)
        # A structured verification step chained behind the one before it runs in two calls
        # (a split step): the target at once, then masks, sampling and the drafter once the
        # host has built the masks (structured outputs only; see dispatch_forward).
        self._spec_fwd = jax.jit(self._spec_forward_impl, static_argnames=("layout",), donate_argnums=(1,),
                                 compiler_options=self.plan.compiler_options)
        self._spec_tail = jax.jit(self._spec_tail_impl, static_argnames=("layout", "filtering"),
                                  donate_argnums=(2, 3), compiler_options=self.plan.compiler_options)
        # Verification rows and prefill chunks in one call (jspec/engine/spec_mixed.py).
        self._spec_mixed = jax.jit(self._spec_mixed_impl, static_argnames=("layout", "filtering"),
                                   donate_argnums=(2, 3, 4), compiler_options=self.plan.compiler_options)

    # ---- device side ------------------------------------------------------------------
    def _spec_step_impl(self, params, dparams, kv, dkv, probs_buf, synthetic_rates, ints, floats, prev=None, *,
                        decode, layout, filtering):
        self._compiling("speculative", layout)  # runs at trace time only
        inp: SpecInput = self._unpack(ints, floats, layout)
        if prev is not None:
            inp = continue_from(inp, prev, self.K, self.page_size, self.num_pages)
        b = inp.base
        h, aux, kv = self.model.apply({"params": params}, b.tokens, b.meta, kv, aux_layers=self.aux_layers)
        B = b.tokens.shape[0]
        if decode:
            out = self._verify_and_propose(params, dparams, dkv, probs_buf, synthetic_rates, self._lm(params, h), aux,
                                           b.tokens, b.meta, inp, b, filtering, h)
            return (kv, *out)
        last = self._lm(params, h[jnp.arange(B), last_positions(b)])  # f32[B, V]
        return (kv, *self._prefill_and_propose(params, dparams, dkv, probs_buf, last, h, aux, inp, filtering))

    def _lm(self, params, h):
        return self.model.apply({"params": params}, h, method=Transformer.logits)

    def _prefill_and_propose(self, params, dparams, dkv, probs_buf, logits, h, aux, inp, filtering):
        """A prefill step after the target (h [B, Q, H], aux [B, Q, ...]): sample one token
        from ``logits`` f32[B, V] at each row's last chunk position, then the drafter over
        the shifted prompt (pair tokens from the host) with the sampled token last."""
        b = inp.base
        Q = b.tokens.shape[1]
        last_idx = last_positions(b)
        out, n_emit, logits, raw = self._sample_no_drafts(logits[:, None], b, b.proc, b.sample_pos, filtering)
        at_last = jnp.arange(Q)[None, :] == last_idx[:, None]
        pairs = jnp.where(at_last & inp.sample[:, None], out[:, :1], inp.pair_next)
        return self._propose_and_pack(params, dparams, dkv, probs_buf, pairs, aux, b.meta, last_idx, inp, b,
                                      out, n_emit, logits, raw, h, b.tokens[:, 0])

    def _verify_and_propose(self, params, dparams, dkv, probs_buf, synthetic_rates, logits, aux, tokens, meta,
                            inp, s, filtering, h):
        """A verification step after the target: masks and processors on ``logits``
        f32[B, Q, V], ``rejection_sample`` of the drafts tokens[:, 1:], then the drafter;
        ``inp`` gives num_draft, sample and prob_rows, ``s`` the sampling fields."""
        q = probs_buf[inp.prob_rows] if self.with_probs else None
        # Position j sees the drafts before it (logits_processing: penalties, bad words...).
        logits, raw = self._process(logits, s, s.proc, tokens[:, 1:])
        out, n_emit = rejection_sample(
            logits, tokens[:, 1:], inp.num_draft, q, s.temperature, s.top_k, s.top_p, s.seeds, s.sample_pos,
            method=self.spec.rejection_sample_method, synthetic_rates=synthetic_rates,
            impl=self.sample_impl, filtering=filtering,
        )
        pairs = jnp.maximum(out, 0)  # [B, K+1] == [B, Q]
        return self._propose_and_pack(params, dparams, dkv, probs_buf, pairs, aux, meta, n_emit - 1, inp, s,
                                      out, n_emit, logits, raw, h, tokens[:, 0])

    def _propose_and_pack(self, params, dparams, dkv, probs_buf, pairs, aux, meta, last_idx, inp, s, out, n_emit,
                          logits, raw, h, first):
        """The drafter over the step's pairs i32[B, Q] (``first`` i32[B]: the step's first
        token), then the step's one packed output."""
        B, Q = pairs.shape
        aux = None if aux is None else aux.reshape(B, Q, -1)  # None: no aux layers (n-gram, a draft model)
        draft_temp = s.temperature if self.with_probs else jnp.zeros_like(s.temperature)
        embed, lm_head = self.embedding_table(params), self.lm_head_weight(params)
        drafts, probs, dkv = self.drafter.propose(
            dparams, dkv,
            ProposeInputs(pairs, aux, meta, last_idx, embed, lm_head, s.seeds, draft_temp, inp.sample, first),
            num_tokens=self.K, with_probs=self.with_probs,
        )
        if self.with_probs:
            rows = jnp.where(inp.sample, inp.prob_rows, probs_buf.shape[0])  # padding rows: dropped
            probs_buf = probs_buf.at[rows].set(probs[:, : self.K], mode="drop")  # the registry allows >= K
        # One int32 block [B, (K+1) + 1 + K]: a single device->host read per step.
        # A prefill step emits one token: padded to K + 1 so read_spec finds the drafts.
        out = jnp.pad(out, ((0, 0), (0, self.K + 1 - out.shape[1])), constant_values=-1)
        parts = [out, n_emit[:, None], drafts[:, : self.K].astype(jnp.int32)]
        if s.proc is not None:  # logprob blocks of the emitted tokens ride along: still one read
            lp = self._token_logprobs(raw, logits, out[:, : logits.shape[1]], s)  # [B, 1 or K+1, F]
            lp = jnp.pad(lp, ((0, 0), (0, self.K + 1 - lp.shape[1]), (0, 0)))
            parts += [lp.reshape(B, -1), self._prompt_logprobs(params, h, s.proc).reshape(B, -1)]
        return dkv, probs_buf, jnp.concatenate(parts, axis=1)

    def _spec_forward_impl(self, params, kv, ints, floats, prev, *, layout):
        """A split (structured) verification step's forward, chained behind ``prev``: the
        target over [bonus, K drafts] -> (kv, (logits f32[B, Q, V], aux, tokens i32[B, Q],
        meta)), what ``_spec_tail_impl`` reads."""
        self._compiling("speculative split forward", layout)  # runs at trace time only
        inp = continue_from(self._unpack(ints, floats, layout), prev, self.K, self.page_size, self.num_pages)
        b = inp.base
        h, aux, kv = self.model.apply({"params": params}, b.tokens, b.meta, kv, aux_layers=self.aux_layers)
        return kv, (self._lm(params, h), aux, b.tokens, b.meta)

    def _spec_tail_impl(self, params, dparams, dkv, probs_buf, synthetic_rates, fwd, ints, floats, *, layout,
                        filtering):
        """A split verification step's tail: the masks (and sampling fields) the host built
        after reading the step before, rejection sampling and the drafter, on ``fwd``.
        Same maths and output as the one-call step."""
        self._compiling("speculative split tail", layout)  # runs at trace time only
        s: SampleInput = self._unpack(ints, floats, layout)
        logits, aux, tokens, meta = fwd
        return self._verify_and_propose(params, dparams, dkv, probs_buf, synthetic_rates, logits, aux, tokens, meta,
                                        s, s, filtering, None)

    # ---- host side --------------------------------------------------------------------
    def build_spec_input(self, sched: SchedulerOutput, chained: bool = False, forward_only: bool = False, *,
                         B: int | None = None, W: int | None = None,
                         Q: int | None = None) -> tuple[SpecInput, int, bool]:
        """The step's input from the host state. ``chained``: for a verification step that
        continues one still on the device (``continue_from``): every row verifies K drafts,
        tokens and the position shift come from that step. ``forward_only``: without
        processors or masks (a split step's forward). ``B``, ``W``, ``Q``: given buckets
        (a mixed step's segments, jspec/engine/spec_mixed.py)."""
        decode = sched.kind == "decode"
        if chained:
            sched = SchedulerOutput("decode", [ScheduledSeq(r.seq, self.K + 1, True) for r in sched.seqs], [])
        Q = Q or (self.K + 1 if decode else self.chunk_q(sched))
        base, n = self.build_input(sched, Q, tokens_on_device=chained, forward_only=forward_only, B=B, W=W)
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

    def dispatch_spec(self, sched: SchedulerOutput, running: set | None = None,
                      prev: jax.Array | None = None) -> jax.Array:
        """Start a speculative step (chained behind ``prev`` when given); its packed output
        stays on the device until ``read_spec``. ``running``: the running request ids, for
        ``assign_prob_rows`` (a chained step keeps the rows of the step it continues)."""
        if prev is None:
            self.assign_prob_rows(sched, running)
        inp, _, decode = self.build_spec_input(sched, chained=prev is not None)
        return self.run_spec(inp, decode, prev)

    def dispatch_forward(self, sched: SchedulerOutput, prev: jax.Array) -> Split:
        """The target's half of the verification step after ``prev`` (a step not yet read),
        dispatched before the host builds that step's masks (``dispatch_tail``): a structured
        batch's masks need ``prev``'s tokens and drafts, which the host reads meanwhile."""
        return self.run_forward(self.build_spec_input(sched, chained=True, forward_only=True)[0], prev)

    def run_forward(self, inp: SpecInput, prev: jax.Array) -> Split:
        ints, floats, layout = pack(inp)
        self.kv, fwd = self._spec_fwd(self.params, self.kv, ints, floats, prev, layout=self._layout_id(layout))
        B, Q = inp.base.tokens.shape
        return Split(fwd, B, Q, inp.base.meta.page_table.shape[1] * self.page_size)

    def dispatch_tail(self, split: Split, sched: SchedulerOutput) -> jax.Array:
        """The rest of a split step (masks, rejection sampling, the drafter) from the host
        state now: each running row verifies its grammar-valid drafts. Returns the packed
        output, as ``dispatch_spec``."""
        s = self.build_sample_input(sched, split)
        for i, r in enumerate(sched.seqs):
            s.prob_rows[i] = self._prob_rows.get(r.seq.request_id, 0)
        return self.run_tail(split, s)

    def run_tail(self, split: Split, s: SampleInput) -> jax.Array:
        ints, floats, layout = pack(s)
        self.dkv, self.probs_buf, packed = self._spec_tail(
            self.params, self.dparams, self.dkv, self.probs_buf, self.synthetic_rates, split.fwd, ints, floats,
            layout=self._layout_id(layout), filtering=self._filtering(s),
        )
        return packed

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
        """Run one step and read it (a "mixed" step: decode rows first, as scheduled)."""
        if sched.kind == "mixed":
            self.assign_prob_rows(sched, running)
            return self.execute_spec_mixed(sched)
        return self.read_spec(self.dispatch_spec(sched, running), len(sched.seqs))

    def warmup_shapes(self, num_scheduler_steps: int = 1, async_scheduling: bool = False) -> list[StepShape]:
        """Every shape the speculative step compiles for: verification (Q = K + 1), with
        async scheduling also its chained form (steps = 1: continues a step on the device),
        and the prefill chunk buckets, for each batch and page-table bucket. A mixing engine
        prefills at most buckets.prefill_rows rows per step and adds the mixed steps
        (``prefill_rows`` > 0, jspec/engine/spec_mixed.py). (num_scheduler_steps does not
        apply to speculation.)"""
        b = self.buckets
        qs = [(self.K + 1, 0, True)] + ([(self.K + 1, 1, True)] if async_scheduling else [])
        qs += [(Q, 0, False) for Q in b.prefill_q]
        return [StepShape(B, Q, W, steps, decode) for B in b.batch for Q, steps, decode in qs
                for W in b.pages if decode or B in b.prefill_batch] + mixed_shapes(b)

    def empty_spec_input(self, sh: StepShape) -> SpecInput:
        """A step of shape ``sh`` with no active row: nothing samples, drafts or writes."""
        B, Q = sh.batch, sh.q
        zeros = np.zeros((B,), np.int32)
        return SpecInput(self.empty_input(B, Q, sh.pages), zeros, np.zeros((B, Q), np.int32), np.zeros((B,), bool),
                         zeros)

    def _empty_prev(self, sh: StepShape):
        """A stand-in ``prev`` for compiling the chained form (steps = 1), else None."""
        return replicate(jnp.zeros((sh.batch, 2 * self.K + 2), jnp.int32), self.plan.mesh) if sh.steps else None

    def lower_spec(self, sh: StepShape):
        """The speculative step of shape ``sh``, lowered (not run): ``.compile()`` gives its
        executable and ``memory_analysis()`` (tests check it needs no cache-sized copies)."""
        if sh.prefill_rows:
            return self.lower_spec_mixed(sh)
        inp = self.empty_spec_input(sh)
        ints, floats, layout = pack(inp)
        return self._spec_step.lower(
            self.params, self.dparams, self.kv, self.dkv, self.probs_buf, self.synthetic_rates, ints, floats,
            self._empty_prev(sh), decode=sh.decode, layout=self._layout_id(layout),
            filtering=self._filtering(inp.base),
        )

    def lower_shape(self, sh: StepShape):
        """``warmup``'s call for ``sh``, lowered (``RunnerBase.precompile``)."""
        return self.lower_spec(sh)

    def warmup(self, num_scheduler_steps: int = 1, async_scheduling: bool = False, shapes=None,
               structured: bool = False):
        """Compile every shape (or ``shapes``, a subset of ``warmup_shapes``) with empty rows:
        no row samples or drafts, every target and drafter write is dropped, so the caches
        and the draft-probability buffer keep their contents. ``structured``: also the
        masked steps of a batch with a grammar: prefill chunks, verification, and with
        async scheduling the split step's two calls, and the mixed steps."""
        shapes = shapes or self.warmup_shapes(num_scheduler_steps, async_scheduling)
        for sh in shapes:
            if not sh.prefill_rows:
                self.run_spec(self.empty_spec_input(sh), sh.decode, self._empty_prev(sh))
        self.warmup_spec_mixed([sh for sh in shapes if sh.prefill_rows])
        for sh in self.warmup_shapes(1, async_scheduling) if structured else ():
            if sh.prefill_rows:
                self.run_spec_mixed(self.empty_spec_mixed_input(sh, masked=True))
                continue
            inp = self.empty_spec_input(sh)
            if sh.steps:  # the chained form: split in two
                split = self.run_forward(inp, self._empty_prev(sh))
                self.run_tail(split, self.empty_sample_input(sh.batch, sh.q))
                continue
            mask = self.allow_all(sh.batch, sh.q if sh.decode else 1)
            self.run_spec(inp.replace(base=inp.base.replace(grammar_mask=mask)), sh.decode)
        jax.block_until_ready((self.kv, self.dkv))
