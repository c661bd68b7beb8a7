"""The plain runner over flat steps: every step one flat token batch (flat_input.py).

A step of any kind (prefill chunks, decode rows, both mixed) is one call of one jitted
function over the step's T tokens, bucketed by the two shape families of ``FlatShapes``:
  tokens i32[T] --Transformer over [1, T] with RaggedMetadata--> hidden [1, T, H]
  hidden at logits_idx [N, Q] --lm_head--> logits f32[N, Q, V]
  masks, processors, rejection_sample with no drafts --> i32[N] (+ logprob blocks)
Async scheduling's chained decode call is the same function with ``steps`` >= 1: a decode
step of the decode family, fed back on the device ``steps`` times, its first token taken
from the previous call's output. A batch with a grammar chained behind another splits in
two calls (the forward, then masks and sampling once the host has built the masks).
Three jitted functions in all: ``_step``, ``_fwd`` and ``_tail``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jspec.drafters.propose import slots_for
from jspec.engine.flat_input import FlatInput, FlatShape, FlatShapes, build_flat_input
from jspec.engine.logits_processing import extend_history
from jspec.engine.logprobs import logprob_info
from jspec.engine.packing import pack
from jspec.engine.runner_base import RunnerBase, SampleInput, Split, tokens_of
from jspec.engine.scheduler import SchedulerOutput
from jspec.models.transformer import Transformer
from jspec.parallel import replicate


class FlatRunner(RunnerBase):
    def __init__(self, cfg, params, kv, shapes: FlatShapes, *, width: int, dtype, plan):
        """``width``: pages of the longest sequence (max_model_len plus lookahead): the page
        table's one width."""
        super().__init__(cfg, params, kv, None, dtype=dtype, plan=plan)
        self.shapes = shapes
        self.width = width
        self.num_mixed_steps = 0  # steps with decode rows and prefill chunks (engine stats)
        opts = self.plan.compiler_options
        # `filtering` ("off" | "on": does any request use top-k / top-p) is decided on the
        # host per step: a device-side lax.cond would read its predicate on the host (a
        # ~50 us sync per step on the H200). Top-k / top-p traffic compiles a second variant.
        self._step = jax.jit(self._step_impl, donate_argnums=(1,), static_argnames=("layout", "steps", "filtering"),
                             compiler_options=opts)
        self._fwd = jax.jit(self._forward_impl, donate_argnums=(1,), static_argnames=("layout",),
                            compiler_options=opts)
        self._tail = jax.jit(self._tail_impl, static_argnames=("layout", "filtering"), compiler_options=opts)
        self._no_prev: dict = {}  # (N, steps) -> zeros: the ``prev`` of an unchained fed-back call

    # ---- device side ------------------------------------------------------------------
    def _step_impl(self, params, kv, ints, floats, prev, *, layout, steps: int, filtering):
        """steps = 0: one step over the input's T tokens -> i32[N] (with processors: (tokens,
        logprob blocks i32[N, F], prompt logprob blocks i32[T, F])). steps >= 1: that many
        decode steps of a decode-family input, each token fed back -> i32[N, steps] (with
        processors also i32[N, steps, F])."""
        self._compiling("plain" if steps == 0 else "plain fed-back", layout)  # runs at trace time only
        inp: FlatInput = self._unpack(ints, floats, layout)
        if steps:
            return self._decode_loop(params, kv, inp, prev, steps, filtering)
        h, _, kv = self.model.apply({"params": params}, inp.tokens[None], inp.meta, kv)
        logits = self._lm(params, h[0][inp.logits_idx[:, :1]])  # f32[N, 1, V]: one sampled position per row
        tokens, lp = self._sample_one(logits, inp, inp.proc, inp.sample_pos, filtering)
        if lp is None:
            return kv, tokens[:, 0]
        return kv, (tokens[:, 0], lp[:, 0], self._flat_prompt_logprobs(params, h[0], inp.proc))

    def _sample_one(self, logits, s, proc, sample_pos, filtering):
        """``_sample_no_drafts`` -> (i32[N, 1], the logprob blocks i32[N, 1, F] or None without
        ``proc``)."""
        out, _, logits, raw = self._sample_no_drafts(logits, s, proc, sample_pos, filtering)
        return out, None if proc is None else self._token_logprobs(raw, logits, out, s)

    def _lm(self, params, h):
        return self.model.apply({"params": params}, h, method=Transformer.logits)

    def _flat_prompt_logprobs(self, params, h, proc):
        """i32[T, F] logprob blocks of each token's next prompt token (T = 0 unless a row of
        this prefill step asks for prompt logprobs): raw, as vLLM's."""
        if proc.prompt_next.shape[0] == 0:
            return proc.prompt_next[:, None]
        return logprob_info(self._lm(params, h), proc.prompt_next, self.n_top_logprobs)

    def _decode_loop(self, params, kv, inp: FlatInput, prev, steps: int, filtering):
        """``steps`` decode steps of N one-token rows (the decode family, T = N), each token
        fed back on the device; host tokens -1 start from ``prev[:, -1]`` (the call before,
        not yet read). Same maths and RNG keys as ``steps`` one-step calls."""
        m = inp.meta
        N = inp.sample.shape[0]
        first = jnp.where(inp.tokens < 0, prev[:, -1], inp.tokens)
        active = jnp.arange(N) < m.num_seqs[0]
        ps, P = self.page_size, self.num_pages
        proc, hist = inp.proc, None
        if proc is not None:  # a chained call's history lacks the previous call's tokens
            chained = active & (inp.tokens < 0)
            hist = extend_history(proc.hist, proc.n_hist, prev, jnp.where(chained, prev.shape[1], 0))

        def body(carry, t):
            kv, tok, hist = carry
            pos = m.positions[0] + t  # i32[N]
            slot = slots_for(m.page_table, pos[:, None], active[:, None], ps, P)[:, 0]
            meta = m.replace(positions=pos[None], slot_mapping=slot[None], kv_lens=jnp.where(active, pos + 1, 0))
            h, _, kv = self.model.apply({"params": params}, tok[None], meta, kv)
            logits = self._lm(params, h[0])[:, None]  # f32[N, 1, V]
            p = None if proc is None else proc.replace(hist=hist[0], n_hist=hist[1])
            out, lp = self._sample_one(logits, inp, p, inp.sample_pos + t, filtering)
            if proc is None:
                return (kv, out[:, 0], hist), out[:, 0]
            hist = extend_history(*hist, out, active.astype(jnp.int32))
            return (kv, out[:, 0], hist), (out[:, 0], lp[:, 0])

        (kv, _, _), ys = jax.lax.scan(body, (kv, first, hist), jnp.arange(steps, dtype=jnp.int32))
        if proc is None:
            return kv, ys.T  # i32[N, steps]
        return kv, (ys[0].T, ys[1].transpose(1, 0, 2))  # i32[N, steps], i32[N, steps, F]

    def _forward_impl(self, params, kv, ints, floats, prev, *, layout):
        """A split decode step's forward: one token per row (host token -1: ``prev[:, -1]``,
        the call before, still on the device) -> (kv, logits f32[N, 1, V])."""
        self._compiling("plain split forward", layout)  # runs at trace time only
        inp: FlatInput = self._unpack(ints, floats, layout)
        tok = jnp.where(inp.tokens < 0, prev[:, -1], inp.tokens)
        h, _, kv = self.model.apply({"params": params}, tok[None], inp.meta, kv)
        return kv, self._lm(params, h[0][inp.logits_idx[:, :1]])

    def _tail_impl(self, logits, ints, floats, *, layout, filtering):
        """A split decode step's tail: masks, processors and sampling on the forward's logits
        f32[N, 1, V] -> i32[N, 1] (with processors also the logprob blocks i32[N, 1, F]): the
        output of a one-step fed-back call, which the next call can chain behind."""
        self._compiling("plain split sampling", layout)  # runs at trace time only
        s: SampleInput = self._unpack(ints, floats, layout)
        out, lp = self._sample_one(logits, s, s.proc, s.sample_pos, filtering)
        return out if lp is None else (out, lp)

    # ---- host side --------------------------------------------------------------------
    def shape_of(self, sched: SchedulerOutput, steps: int = 0) -> FlatShape:
        if sched.kind == "decode":
            return self.shapes.decode_shape(len(sched.seqs), steps)
        return self.shapes.general_shape(sum(r.num_new for r in sched.seqs))

    def build(self, sched: SchedulerOutput, shape: FlatShape, **kw) -> FlatInput:
        return build_flat_input(sched, shape, self.shapes, page_size=self.page_size, num_pages=self.num_pages,
                                width=self.width, vocab_size=self.cfg.vocab_size, eos_token_ids=self.eos_token_ids,
                                **kw)

    def run(self, inp: FlatInput, steps: int = 0, prev: jax.Array | None = None):
        """One jitted call on a host-built input (two transfers), returned without waiting
        for the device (``_step_impl``'s output)."""
        fn, args, kw = self._call(inp, steps, prev)
        self.kv, out = fn(*args, **kw)
        return out

    def _call(self, inp: FlatInput, steps: int, prev):
        """(jitted function, arguments, static keywords) of ``run``'s call."""
        ints, floats, layout = pack(inp)
        if steps and prev is None:
            key = (inp.sample.shape[0], steps)
            if key not in self._no_prev:
                self._no_prev[key] = replicate(jnp.zeros(key, jnp.int32), self.plan.mesh)
            prev = self._no_prev[key]
        kw = dict(layout=self._layout_id(layout), steps=steps, filtering=self._filtering(inp))
        return self._step, (self.params, self.kv, ints, floats, prev), kw

    def execute(self, sched: SchedulerOutput):
        """Run one step; returns, per scheduled sequence, the tokens it emitted ([] if none),
        and with processors the logprob blocks i32[n, 1, F] of those tokens and i32[n, P, F]
        of the prompt tokens after each position (else None, None)."""
        n = len(sched.seqs)
        self.num_mixed_steps += sched.kind == "mixed"
        out = self.run(self.build(sched, self.shape_of(sched)))
        sampled = np.asarray(tokens_of(out))
        toks = [[int(sampled[i])] if sched.seqs[i].sample else [] for i in range(n)]
        if not isinstance(out, tuple):
            return toks, None, None
        lp, flat_plp = np.asarray(out[1])[:n, None], np.asarray(out[2])
        P = max(r.num_new for r in sched.seqs) if flat_plp.shape[0] else 0
        plp = np.zeros((n, P, flat_plp.shape[-1]), np.int32)
        off = 0
        for i, r in enumerate(sched.seqs):
            if P:
                plp[i, : r.num_new] = flat_plp[off : off + r.num_new]
            off += r.num_new
        return toks, lp, plp

    def dispatch_decode(self, sched: SchedulerOutput, steps: int, prev: jax.Array | None = None) -> jax.Array:
        """Start ``steps`` fed-back decode steps; i32[N, steps] on the device (rows past the
        scheduled ones are padding). With ``prev`` (the output of a call not yet read) the
        call continues that one: positions start ``steps`` further, tokens from ``prev``."""
        prev = None if prev is None else tokens_of(prev)
        inp = self.build(sched, self.shape_of(sched, steps), advance=0 if prev is None else prev.shape[1])
        return self.run(inp, steps, prev)

    def dispatch_forward(self, sched: SchedulerOutput, prev) -> Split:
        """The forward of the decode step after ``prev`` (a one-step call not yet read),
        dispatched before the host builds that step's masks (``dispatch_tail``)."""
        prev = tokens_of(prev)
        inp = self.build(sched, self.shape_of(sched, 1), advance=prev.shape[1], forward_only=True)
        return self.run_forward(inp, prev)

    def run_forward(self, inp: FlatInput, prev: jax.Array) -> Split:
        ints, floats, layout = pack(inp)
        self.kv, logits = self._fwd(self.params, self.kv, ints, floats, prev, layout=self._layout_id(layout))
        return Split(logits, inp.sample.shape[0], 1, self.width * self.page_size)

    def dispatch_tail(self, split: Split, sched: SchedulerOutput):
        """The rest of a split step, from the host state now (the step before it read): as
        ``dispatch_decode``'s output, i32[N, 1] on the device."""
        return self.run_tail(split, self.build_sample_input(sched, split))

    def run_tail(self, split: Split, s: SampleInput):
        ints, floats, layout = pack(s)
        return self._tail(split.fwd, ints, floats, layout=self._layout_id(layout), filtering=self._filtering(s))

    # ---- the closed set of shapes -----------------------------------------------------
    def warmup_shapes(self, num_scheduler_steps: int = 1, async_scheduling: bool = False) -> list[FlatShape]:
        """Every shape a step can have: the general family, and the decode family as its
        decode steps run: with async scheduling fed back one step per call (steps 1: every
        decode step, chained or not), ``num_scheduler_steps`` > 1 at a time, and the one-step
        host-fed call (steps 0) where a decode step is neither (async scheduling off, a batch
        that cannot grow ``num_scheduler_steps`` positions)."""
        multi = num_scheduler_steps > 1
        steps = ({0} if multi or not async_scheduling else set()) | ({num_scheduler_steps} if multi else set())
        steps |= {1} if async_scheduling else set()  # with num_scheduler_steps > 1: a batch with a grammar
        return self.shapes.all(tuple(sorted(steps)))

    def empty_input(self, shape: FlatShape) -> FlatInput:
        """An input of ``shape`` with no sequence (num_seqs 0, every slot dropped): compiles a
        shape without touching the cache."""
        return self.build(SchedulerOutput("decode" if shape.decode else "prefill", [], []), shape)

    def lower_shape(self, shape: FlatShape):
        """``warmup``'s call for ``shape``, lowered (``RunnerBase.precompile``)."""
        fn, args, kw = self._call(self.empty_input(shape), shape.steps, None)
        return fn.lower(*args, **kw)

    def warmup(self, num_scheduler_steps: int = 1, async_scheduling: bool = False, shapes=None,
               structured: bool = False):
        """Compile every shape (or ``shapes``, a subset of ``warmup_shapes``) with empty
        inputs (all writes dropped: the cache is unchanged). ``structured``: also the masked steps a batch with a grammar takes."""
        for shape in shapes or self.warmup_shapes(num_scheduler_steps, async_scheduling):
            self.run(self.empty_input(shape), shape.steps)
        for shape in self.warmup_shapes(num_scheduler_steps, async_scheduling) if structured else ():
            # a batch with a grammar: one step per call, a chained one split in two
            inp = self.empty_input(shape)
            masked = inp.replace(grammar_mask=self.allow_all(shape.seqs, self.shapes.q))
            if shape.steps == 0:
                self.run(masked)
            elif shape.steps == 1:
                self.run(masked, 1)
                split = self.run_forward(inp, jnp.zeros((shape.seqs, 1), jnp.int32))
                self.run_tail(split, self.empty_sample_input(shape.seqs, 1))
        jax.block_until_ready(self.kv)
