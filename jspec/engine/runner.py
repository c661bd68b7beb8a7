"""The plain (non-speculative) runner: the jitted step and the fed-back decode call.

``ModelRunner.execute`` turns a ``SchedulerOutput`` into a ``StepInput`` padded to a
bucket (batch B, query width Q, page-table width W; ``RunnerBase.build_input``), calls the
jitted step with the KV cache donated, and hands back per-sequence tokens. The number of
distinct compiled shapes is at most |batch buckets| x (|prefill buckets| + 1) x |page buckets|,
plus the mixed steps' (jspec/engine/mixed.py) when the engine mixes decode and prefill rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.engine.logits_processing import extend_history
from jspec.engine.mixed import MixedSteps, mixed_shapes
from jspec.engine.packing import pack
from jspec.engine.runner_base import RunnerBase, SampleInput, Split, StepInput, StepShape, tokens_of
from jspec.engine.scheduler import SchedulerOutput
from jspec.kv_cache import AttentionMetadata
from jspec.models.transformer import Transformer
from jspec.parallel import replicate


class ModelRunner(MixedSteps, RunnerBase):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # `filtering` ("off" | "on": does any request use top-k / top-p) is decided on the
        # host per step: a device-side lax.cond would read its predicate on the host (a
        # ~50 us sync per step on the H200). Top-k / top-p traffic compiles a second variant.
        opts = self.plan.compiler_options
        self._step = jax.jit(self._step_impl, donate_argnums=(1,), static_argnames=("layout", "filtering"),
                             compiler_options=opts)
        self._multi = jax.jit(self._multi_step_impl, donate_argnums=(1,),
                              static_argnames=("layout", "steps", "filtering"), compiler_options=opts)
        self._mixed = jax.jit(self._mixed_impl, donate_argnums=(1,), static_argnames=("layout", "filtering"),
                              compiler_options=opts)  # decode rows + prefill chunks (jspec/engine/mixed.py)
        self._no_prev: dict = {}  # (B, steps) -> zeros, the ``prev`` of an unchained decode call
        # A structured decode step chained behind the one before it runs in two calls (a
        # split step): the forward, dispatched at once, then the masks and sampling, once
        # the host has built the masks (structured outputs only; see dispatch_forward).
        self._fwd = jax.jit(self._forward_impl, donate_argnums=(1,), static_argnames=("layout",),
                            compiler_options=opts)
        self._tail = jax.jit(self._sample_impl, static_argnames=("layout", "filtering"), compiler_options=opts)

    def step_q(self, sched: SchedulerOutput) -> int:
        """Q of the plain step: 1 per decode row, else the prefill chunk bucket."""
        return 1 if sched.kind == "decode" else self.chunk_q(sched)

    # ---- device side ------------------------------------------------------------------
    def _step_impl(self, params, kv, ints, floats, *, layout, filtering):
        self._compiling("plain", layout)  # runs at trace time only
        inp: StepInput = self._unpack(ints, floats, layout)
        h, _, kv = self.model.apply({"params": params}, inp.tokens, inp.meta, kv)
        B = h.shape[0]
        last = h[jnp.arange(B), jnp.maximum(inp.q_lens - 1, 0)]  # [B, H]
        logits = self.model.apply({"params": params}, last, method=Transformer.logits)  # f32[B, V]
        return kv, self._sample(params, h, logits, inp, filtering)

    def _sample(self, params, h, logits, inp: StepInput, filtering):
        """The plain step's token per row from the logits f32[B, V] at its last position
        (h: the step's hidden states [B, Q, H], for prompt logprobs): i32[B], or with
        processors (tokens, logprob blocks i32[B, F], prompt logprob blocks i32[B, P, F])."""
        tokens, lp = self._sample_one(logits[:, None, :], inp, inp.proc, inp.sample_pos, filtering)
        if lp is None:
            return tokens[:, 0]
        return tokens[:, 0], lp[:, 0], self._prompt_logprobs(params, h, inp.proc)

    def _sample_one(self, logits, s, proc, sample_pos, filtering):
        """``_sample_no_drafts`` -> (i32[B, 1], the logprob blocks i32[B, 1, F] or None without
        ``proc``)."""
        out, _, logits, raw = self._sample_no_drafts(logits, s, proc, sample_pos, filtering)
        return out, None if proc is None else self._token_logprobs(raw, logits, out, s)

    def _multi_step_impl(self, params, kv, ints, floats, prev, *, layout, steps: int, filtering):
        """``steps`` decode steps in one call, each sampled token fed back on the device.

        Host bookkeeping (and its ~1 ms per step on the H200) is paid once per call. Same
        maths and RNG keys as ``steps`` single calls: step t samples at sample_pos + t.
        ``prev`` (i32[B, steps']) is the previous call's output, still on the device: a row
        whose host token is -1 starts from ``prev[b, -1]`` (async scheduling dispatches
        this call before the host has read that token).
        """
        self._compiling("plain multi-step", layout)  # runs at trace time only
        inp: StepInput = self._unpack(ints, floats, layout)
        first = jnp.where(inp.tokens[:, 0] < 0, prev[:, -1], inp.tokens[:, 0])
        ps, drop = self.page_size, self.num_pages * self.page_size
        table = inp.meta.page_table
        active = inp.q_lens > 0
        proc = inp.proc
        hist = None
        if proc is not None:  # a chained call's history lacks the previous call's tokens
            chained = active & (inp.tokens[:, 0] < 0)
            hist = extend_history(proc.hist, proc.n_hist, prev, jnp.where(chained, prev.shape[1], 0))

        def body(carry, t):
            kv, tok, hist = carry
            pos = inp.meta.positions[:, 0] + t  # i32[B]
            page = jnp.take_along_axis(table, (pos // ps)[:, None], axis=1)[:, 0]
            slot = jnp.where(active, page * ps + pos % ps, drop)
            meta = AttentionMetadata(table, jnp.where(active, pos + 1, 0), pos[:, None], slot[:, None], inp.meta.causal)
            h, _, kv = self.model.apply({"params": params}, tok[:, None], meta, kv)
            logits = self.model.apply({"params": params}, h[:, 0], method=Transformer.logits)
            p = None if proc is None else proc.replace(hist=hist[0], n_hist=hist[1])
            out, lp = self._sample_one(logits[:, None], inp, p, inp.sample_pos + t, filtering)
            if proc is None:
                return (kv, out[:, 0], hist), out[:, 0]
            hist = extend_history(*hist, out, active.astype(jnp.int32))
            return (kv, out[:, 0], hist), (out[:, 0], lp[:, 0])

        (kv, _, _), ys = jax.lax.scan(body, (kv, first, hist), jnp.arange(steps, dtype=jnp.int32))
        if proc is None:
            return kv, ys.T  # i32[B, steps]
        return kv, (ys[0].T, ys[1].transpose(1, 0, 2))  # i32[B, steps], i32[B, steps, F]

    def _forward_impl(self, params, kv, ints, floats, prev, *, layout):
        """A split decode step's forward: one token per row (host token -1: ``prev[b, -1]``,
        the output of the call before, still on the device) -> (kv, logits f32[B, 1, V])."""
        self._compiling("plain split forward", layout)  # runs at trace time only
        inp: StepInput = self._unpack(ints, floats, layout)
        tok = jnp.where(inp.tokens < 0, prev[:, -1:], inp.tokens)
        h, _, kv = self.model.apply({"params": params}, tok, inp.meta, kv)
        return kv, self.model.apply({"params": params}, h[:, 0], method=Transformer.logits)[:, None]

    def _sample_impl(self, logits, ints, floats, *, layout, filtering):
        """A split decode step's tail: masks, processors and sampling on the forward's logits
        f32[B, 1, V] -> i32[B, 1] (with processors also the logprob blocks i32[B, 1, F]): the
        output of a one-step fed-back call, which the next call can chain behind."""
        self._compiling("plain split sampling", layout)  # runs at trace time only
        s: SampleInput = self._unpack(ints, floats, layout)
        out, lp = self._sample_one(logits, s, s.proc, s.sample_pos, filtering)
        return out if lp is None else (out, lp)

    # ---- host side --------------------------------------------------------------------
    def dispatch_forward(self, sched: SchedulerOutput, prev) -> Split:
        """The forward of the decode step after ``prev`` (a one-step call not yet read),
        dispatched before the host builds that step's masks (``dispatch_tail``)."""
        prev = tokens_of(prev)
        return self.run_forward(self.build_input(sched, 1, advance=prev.shape[1], forward_only=True)[0], prev)

    def run_forward(self, inp: StepInput, prev: jax.Array) -> Split:
        ints, floats, layout = pack(inp)
        self.kv, logits = self._fwd(self.params, self.kv, ints, floats, prev, layout=self._layout_id(layout))
        return Split(logits, inp.tokens.shape[0], 1, inp.meta.page_table.shape[1] * self.page_size)

    def dispatch_tail(self, split: Split, sched: SchedulerOutput):
        """The rest of a split step, from the host state now (the step before it read): as
        ``dispatch_decode``'s output, i32[B, 1] on the device."""
        return self.run_tail(split, self.build_sample_input(sched, split))

    def run_tail(self, split: Split, s: SampleInput):
        ints, floats, layout = pack(s)
        return self._tail(split.fwd, ints, floats, layout=self._layout_id(layout), filtering=self._filtering(s))

    def run(self, inp: StepInput, steps: int = 0, prev: jax.Array | None = None):
        """One jitted call on a host-built input (two transfers), returned without waiting
        for the device. ``steps`` = 0: the plain step, i32[B] sampled tokens; ``steps`` >= 1:
        that many decode steps fed back on the device (``_multi_step_impl``), i32[B, steps]."""
        fn, args, kw = self._call(inp, steps, prev)
        self.kv, sampled = fn(*args, **kw)
        return sampled

    def _call(self, inp: StepInput, steps: int, prev):
        """(jitted function, arguments, static keywords) of ``run``'s call."""
        ints, floats, layout = pack(inp)
        kw = dict(layout=self._layout_id(layout), filtering=self._filtering(inp))
        if steps == 0:
            return self._step, (self.params, self.kv, ints, floats), kw
        if prev is None:
            key = (inp.tokens.shape[0], steps)
            if key not in self._no_prev:
                self._no_prev[key] = replicate(jnp.zeros(key, jnp.int32), self.plan.mesh)
            prev = self._no_prev[key]
        return self._multi, (self.params, self.kv, ints, floats, prev), dict(kw, steps=steps)

    def lower_shape(self, shape: StepShape):
        """``warmup``'s call for ``shape``, lowered (``RunnerBase.precompile``)."""
        if shape.prefill_rows:
            fn, args, kw = self._mixed_call(self.empty_mixed_input(shape))
        else:
            fn, args, kw = self._call(self.empty_input(shape.batch, shape.q, shape.pages), shape.steps, None)
        return fn.lower(*args, **kw)

    def dispatch_decode(self, sched: SchedulerOutput, steps: int, prev: jax.Array | None = None) -> jax.Array:
        """Start ``steps`` fed-back decode steps; i32[B, steps] on the device (rows past the
        scheduled ones are padding). With ``prev`` (the output of a call not yet read) the
        call continues that one: positions start ``steps`` further, tokens from ``prev``."""
        prev = None if prev is None else tokens_of(prev)
        inp, _ = self.build_input(sched, 1, advance=0 if prev is None else prev.shape[1])
        return self.run(inp, steps, prev)

    def execute(self, sched: SchedulerOutput):
        """Run one step; returns, per scheduled sequence, the tokens it emitted ([] if none),
        and with processors the logprob blocks i32[n, 1, F] of those tokens and i32[n, P, F]
        of the prompt tokens after each position (else None, None)."""
        if sched.kind == "mixed":
            return self.execute_mixed(sched)
        inp, n = self.build_input(sched, self.step_q(sched))
        out = self.run(inp)
        sampled = np.asarray(tokens_of(out))
        lp, plp = (np.asarray(out[1])[:n, None], np.asarray(out[2])[:n]) if isinstance(out, tuple) else (None, None)
        return [[int(sampled[i])] if sched.seqs[i].sample else [] for i in range(n)], lp, plp

    def warmup_shapes(self, num_scheduler_steps: int = 1, async_scheduling: bool = False) -> list[StepShape]:
        """Every shape the step may compile for: the bounded, known set (steps 0: the plain
        step; >= 1: the fed-back decode call, which with async scheduling and one step per
        call serves every decode step, so the plain Q = 1 step is never needed). A mixing
        engine (buckets.prefill_rows) prefills at most that many rows per step, and adds
        the mixed steps (``prefill_rows`` > 0, jspec/engine/mixed.py)."""
        plain_decode = num_scheduler_steps > 1 or not async_scheduling
        fed = num_scheduler_steps if num_scheduler_steps > 1 or async_scheduling else 0
        shapes = []
        for B in self.buckets.batch:
            for Q in ((1,) if plain_decode else ()) + (self.buckets.prefill_q if B in self.buckets.prefill_batch else ()):
                shapes += [StepShape(B, Q, W, 0, decode=Q == 1) for W in self.buckets.pages]
            if fed:
                shapes += [StepShape(B, 1, W, fed, decode=True) for W in self.buckets.pages]
        return shapes + mixed_shapes(self.buckets)

    def warmup(self, num_scheduler_steps: int = 1, async_scheduling: bool = False, shapes=None,
               structured: bool = False):
        """Compile every bucket (or ``shapes``, a subset of ``warmup_shapes``) with empty rows
        (all writes dropped: the cache is unchanged). ``structured``: also the masked steps
        a batch with a grammar takes (``warmup_structured``)."""
        shapes = shapes or self.warmup_shapes(num_scheduler_steps, async_scheduling)
        for shape in shapes:
            if shape.prefill_rows == 0:
                self.run(self.empty_input(shape.batch, shape.q, shape.pages), shape.steps)
        self.warmup_mixed([s for s in shapes if s.prefill_rows])
        if structured:
            self.warmup_structured(async_scheduling)
        jax.block_until_ready(self.kv)

    def warmup_structured(self, async_scheduling: bool):
        """The masked steps of a batch with a grammar, with empty rows: prefill chunks, and a
        decode step as it runs (with async scheduling the one-step fed-back call and the
        split step's two calls, else the plain step), and the mixed steps (masked_alike).
        Prefill chunks as ``warmup_shapes``: a mixing engine's have at most prefill_rows rows."""
        for B in self.buckets.batch:
            mask = self.allow_all(B, 1)
            for W in self.buckets.pages:
                for Q in (self.buckets.prefill_q if B in self.buckets.prefill_batch else ()) + (() if async_scheduling else (1,)):
                    self.run(self.empty_input(B, Q, W).replace(grammar_mask=mask))
                if async_scheduling:
                    self.run(self.empty_input(B, 1, W).replace(grammar_mask=mask), 1)
                    split = self.run_forward(self.empty_input(B, 1, W), jnp.zeros((B, 1), jnp.int32))
                    self.run_tail(split, self.empty_sample_input(B, 1))
        self.warmup_mixed(mixed_shapes(self.buckets), masked=True)

