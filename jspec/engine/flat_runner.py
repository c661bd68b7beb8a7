"""The runner: every step one flat token batch (flat_input.py), with or without a drafter.

A step of any kind (prefill chunks, decode rows, both mixed) is one call of one jitted
function over the step's T tokens, bucketed by the two shape families of ``FlatShapes``:
  tokens i32[T] --Transformer over [1, T] with RaggedMetadata--> hidden [1, T, H]
  hidden at logits_idx [N, Q] --lm_head--> logits f32[N, Q, V]
  without a drafter (K = 0, Q = 1): masks, processors, sampling --> i32[N]
  with one: rejection sampling and the drafter (flat_spec.py) --> packed i32[N, ...]
Async scheduling's chained decode call is the same function with ``steps`` >= 1: a decode
step fed from the previous call's output on the device (without a drafter ``steps`` of
them, each token fed back; with one, the verification of the drafts that call proposed).
A batch with a grammar chained behind another splits in two calls: the target's forward,
then masks, sampling (and the drafter) once the host has built the masks. Three jitted
functions in all: ``_step``, ``_fwd`` and ``_tail``; each takes the device state
(``EngineState``: the caches, the drafts' probabilities) donated and returns it.
Warmup (jspec/engine/warmup.py) prepares an executable for every call a step can make,
which ``_invoke`` then calls instead of the jitted function.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jspec import ops
from jspec.config import ModelConfig
from jspec.drafters.propose import ProposeInputs, slots_for
from jspec.engine import flat_spec, mirror
from jspec.engine.engine_state import EngineState
from jspec.engine.flat_input import FlatInput, FlatShape, FlatShapes, build_flat_input
from jspec.engine.logits_processing import extend_history
from jspec.engine.logprobs import logprob_info
from jspec.engine.packing import layout_tokens, pack, unpack
from jspec.engine.sampling_step import (
    SampleInput,
    Split,
    build_sample_input,
    filtering_mode,
    process,
    sample_no_drafts,
    token_logprobs,
    tokens_of,
)
from jspec.engine.scheduler import SchedulerOutput
from jspec.kv_cache import KVCache
from jspec.models.transformer import Transformer
from jspec.ops import FP8_GEMM_MIN_ROWS, KernelPlan
from jspec.parallel import replicate
from jspec.parallel.multihost import host_copy

logger = logging.getLogger("jspec.engine")


class FlatRunner:
    # Set by the engine (configure_sampling): what the processors and logprobs need.
    eos_token_ids: tuple = ()  # banned by min_tokens
    n_top_logprobs: int = 20  # top logprobs computed per token (EngineConfig.max_logprobs)
    logprobs_mode: str = "raw_logprobs"

    def __init__(self, cfg: ModelConfig, params, kv: KVCache, shapes: FlatShapes, *, width: int, dtype,
                 plan: KernelPlan, spec=None, dcfg=None, dparams=None, dkv=None, max_num_seqs: int = 1):
        """``width``: pages of the longest sequence (max_model_len plus lookahead): the page
        table's one width. ``plan``: which kernels run (jspec.ops.plan_kernels). ``spec``
        (SpeculativeConfig), ``dcfg``, ``dparams``, ``dkv``: the drafter, K =
        spec.num_speculative_tokens (None: plain decoding, K = 0)."""
        self.cfg, self.params, self.plan = cfg, params, plan
        self.page_size, self.num_pages = kv.page_size, kv.num_pages
        self.model = Transformer(cfg, dtype=dtype, plan=plan)
        self.num_compilations = 0  # traces of the step function (one per new shape)
        self.log_compiles = True  # each on first use (warmup says how many it compiled instead)
        # Packed layouts by index: the jitted steps take the small int as their static
        # argument, which is far cheaper to hash per call than the layout itself.
        self._layout_ids: dict = {}
        self._layouts: list = []
        self.shapes, self.width = shapes, width
        self.num_mixed_steps = 0  # steps with decode rows and prefill chunks (engine stats)
        self.spec, self.dcfg, self.dparams = spec, dcfg, dparams
        self.K = 0 if spec is None else spec.num_speculative_tokens
        self.drafter = self.synthetic_rates = probs = None
        self.with_probs, self.aux_layers = False, ()
        self._prob_rows: dict[str, int] = {}  # request id -> its row of probs_buf (assign_prob_rows)
        if spec is not None:
            from jspec.drafters.registry import make_drafter

            self.drafter = make_drafter(dcfg, dtype=dtype, plan=plan)
            self.aux_layers = tuple(dcfg.aux_layer_ids)
            self.with_probs = spec.draft_sample_method == "probabilistic"
            if self.with_probs:  # the drafts' probabilities, kept on the device between steps
                probs = replicate(jnp.zeros((max_num_seqs, self.K, cfg.vocab_size), jnp.float32), plan.mesh)
            if spec.rejection_sample_method == "synthetic":  # traced: benchmarks swap rates without recompiling
                self.synthetic_rates = replicate(jnp.asarray(spec.synthetic_conditional_rates, jnp.float32),
                                                 plan.mesh)
        opts = self.plan.compiler_options
        # `filtering` ("off" | "on": does any request use top-k / top-p) is decided on the
        # host per step: a device-side lax.cond would read its predicate on the host (a
        # ~50 us sync per step on the H200). Top-k / top-p traffic compiles a second variant.
        # (a step or forward of many tokens compiles with more options: compile_options)
        self._step = jax.jit(self._step_impl, donate_argnums=(2,), compiler_options=opts,
                             static_argnames=("layout", "steps", "filtering"))
        self._fwd = jax.jit(self._forward_impl, donate_argnums=(1,), static_argnames=("layout",),
                            compiler_options=opts)
        self._tail = jax.jit(self._tail_impl, donate_argnums=(1,), static_argnames=("layout", "filtering"),
                             compiler_options=opts)
        self.state = EngineState(kv, dkv, probs)
        self._no_prev: dict = {}  # (N, steps) -> zeros: the ``prev`` of an unchained fed-back call
        # (jitted function's name, its static arguments) -> the executable warmup.prepare made
        self._executables: dict[tuple, object] = {}
        self.num_loaded = 0  # executables loaded from disk (jspec/engine/executables.py)
        self.leader = None  # node 0 of a multi-host engine: its calls go to the others (jspec/engine/mirror.py)

    def configure_sampling(self, eos_token_ids, max_logprobs: int, logprobs_mode: str):
        """What the processors and logprobs read: the eos ids min_tokens bans, the top
        logprobs per token (``max_logprobs``; -1: the whole vocabulary), ``logprobs_mode``."""
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.n_top_logprobs = self.cfg.vocab_size if max_logprobs == -1 else min(max_logprobs, self.cfg.vocab_size)
        self.logprobs_mode = logprobs_mode

    @property
    def kv(self):
        return self.state.kv

    @property
    def dkv(self):
        return self.state.dkv

    @property
    def probs_buf(self):
        return self.state.probs

    def _layout_id(self, layout) -> int:
        if layout not in self._layout_ids:
            self._layout_ids[layout] = len(self._layouts)
            self._layouts.append(layout)
        return self._layout_ids[layout]

    def _unpack(self, ints, floats, layout_id):
        return unpack(ints, floats, self._layouts[layout_id])

    def _compiling(self, what: str, layout_id: int):
        """Count a trace of a jitted step (one per new shape) and say so: on a CPU a first
        call of a shape compiles for seconds, which a user should not take for a hang."""
        self.num_compilations += 1
        if not self.log_compiles:
            return
        shape = self._layouts[layout_id][1][0][1]  # the first packed leaf: the step's tokens [B, Q]
        logger.info("compiling a %s step for tokens %s (its first call; %d step shapes compiled)", what,
                    list(shape), self.num_compilations)

    # ---- device side ------------------------------------------------------------------
    def _step_impl(self, params, dparams, state: EngineState, rates, ints, floats, prev, *, layout, steps: int,
                   filtering):
        """-> (state, out). Without a drafter: steps = 0, one step over the
        input's T tokens, out i32[N] (with processors (tokens, logprob blocks i32[N, F],
        prompt logprob blocks i32[T, F], cu_q_lens)); steps >= 1, that many decode steps each
        fed back, out i32[N, steps] (with processors also i32[N, steps, F]). With one: out
        packed (flat_spec.pack; with processors (packed, prompt blocks i32[T, F], cu_q_lens));
        steps = 1: a verification step whose rows with host tokens -1 continue ``prev``, a
        step not yet read (flat_spec.continue_flat)."""
        self._compiling(("speculative" if self.K else "plain") + (" chained" if steps else ""), layout)
        inp: FlatInput = self._unpack(ints, floats, layout)
        if self.K == 0 and steps:
            kv, out = self._decode_loop(params, state.kv, inp, prev, steps, filtering)
            return state.replace(kv=kv), out
        if steps:
            inp = flat_spec.continue_flat(inp, prev, self.K, self.page_size, self.num_pages)
        off = self.K and inp.logits_idx.shape[1] == 1  # a decode step of width 1: nothing verified
        h, aux, kv = self.model.apply({"params": params}, inp.tokens[None], inp.meta, state.kv,
                                      aux_layers=self.aux_layers)
        state = state.replace(kv=kv)
        logits = self._lm(params, h[0][inp.logits_idx])  # f32[N, Q, V]
        if self.K == 0 or off:
            tokens, lp = self._sample_one(logits, inp, inp.proc, inp.sample_pos, filtering)
            if off:  # packed as a verification that emitted one token and proposed nothing
                N = tokens.shape[0]
                n_emit = jnp.ones((N,), jnp.int32)
                # the drafter's cache still takes the step's pairs (K = 0: it proposes nothing)
                _, _, dkv = self._propose(params, dparams, state, aux, inp, inp, tokens, n_emit, 0)
                state = state.replace(dkv=dkv)
                out = flat_spec.pack(tokens, n_emit, jnp.zeros((N, self.K), jnp.int32), self.K,
                                     None if lp is None else lp.reshape(N, 1, -1))
                if inp.proc is None:
                    return state, out
                return state, (out, self._flat_prompt_logprobs(params, h[0], inp.proc), inp.meta.cu_q_lens)
            if lp is None:
                return state, tokens[:, 0]
            plp = self._flat_prompt_logprobs(params, h[0], inp.proc)
            return state, (tokens[:, 0], lp[:, 0], plp, inp.meta.cu_q_lens)
        state, out = self._verify_and_propose(params, dparams, state, rates, logits, aux, inp, inp, filtering)
        if inp.proc is None:
            return state, out
        return state, (out, self._flat_prompt_logprobs(params, h[0], inp.proc), inp.meta.cu_q_lens)

    def _sample_one(self, logits, s, proc, sample_pos, filtering):
        """``sample_no_drafts`` -> (i32[N, 1], the logprob blocks i32[N, 1, F] or None without
        ``proc``)."""
        out, _, logits, raw = sample_no_drafts(self.plan, logits, s, proc, sample_pos, filtering)
        return out, None if proc is None else self._token_logprobs(raw, logits, out, s)

    def _token_logprobs(self, raw, processed, tokens, inp):
        """``token_logprobs`` under the engine's logprobs settings (configure_sampling)."""
        return token_logprobs(raw, processed, tokens, inp, self.n_top_logprobs, self.logprobs_mode)

    def _verify_and_propose(self, params, dparams, state: EngineState, rates, logits, aux, inp: FlatInput, s,
                            filtering):
        """Verification after the target (flat_spec's module docstring): masks and processors
        on ``logits`` f32[N, Q, V], rejection sampling of each decode row's drafts, then the
        drafter over the step's pairs -> (state, packed). ``s``: the sampling fields (the
        input's own, or a split step's tail's)."""
        drafts = inp.tokens[inp.logits_idx[:, 1:]]  # i32[N, Q - 1]: d_1.. of decode rows (Q <= K + 1)
        k = drafts.shape[1]
        probs_buf = state.probs
        q = probs_buf[s.prob_rows][:, :k] if self.with_probs else None
        logits, raw = process(logits, s, s.proc, drafts)  # position j sees the drafts before it
        out, n_emit = ops.rejection_sample(
            self.plan, logits, drafts, s.num_draft, q, s.temperature, s.top_k, s.top_p, s.seeds, s.sample_pos,
            method=self.spec.rejection_sample_method, synthetic_rates=None if rates is None else rates[:k],
            filtering=filtering)
        N = out.shape[0]
        nxt, probs, dkv = self._propose(params, dparams, state, aux, inp, s, out, n_emit, self.K)
        if self.with_probs:
            rows = jnp.where(s.sample, s.prob_rows, probs_buf.shape[0])  # rows that do not sample: dropped
            probs_buf = probs_buf.at[rows].set(probs[:, : self.K], mode="drop")  # the registry allows >= K
        lp = None if s.proc is None else self._token_logprobs(raw, logits, out, s).reshape(N, k + 1, -1)
        return state.replace(dkv=dkv, probs=probs_buf), flat_spec.pack(out, n_emit, nxt, self.K, lp)

    def _propose(self, params, dparams, state: EngineState, aux, inp: FlatInput, s, out, n_emit, num_tokens: int):
        """The drafter over the step's pairs (out i32[N, Q] emitted, n_emit i32[N]) -> (drafts
        i32[N, num_tokens], probs | None, its cache); num_tokens 0: the cache alone."""
        aux = None if aux is None else aux.reshape(1, aux.shape[1], -1)  # None: no aux layers (n-gram, a draft model)
        with_probs = self.with_probs and num_tokens > 0
        draft_temp = s.temperature if with_probs else jnp.zeros_like(s.temperature)
        return self.drafter.propose(
            dparams, state.dkv,
            ProposeInputs(flat_spec.pairs(inp, out), aux, inp.meta, flat_spec.bonus_index(inp, n_emit),
                          self.embedding_table(params), self.lm_head_weight(params), s.seeds, draft_temp, s.sample,
                          inp.tokens[None]),
            num_tokens=num_tokens, with_probs=with_probs)

    def _lm(self, params, h):
        return self.model.apply({"params": params}, h, method=Transformer.logits)

    # ---- the target's tables, for the drafters (the runner never names parameters) ----
    def embedding_table(self, params):
        """The target's input embedding [V, H]."""
        return self.model.apply({"params": params}, method=Transformer.embedding_table)

    def lm_head_weight(self, params):
        """The target's output projection, in the plan's layout."""
        return self.model.apply({"params": params}, method=Transformer.lm_head_weight)

    def _flat_prompt_logprobs(self, params, h, proc):
        """i32[T, F] logprob blocks of each token's next prompt token (T = 0 unless a row of
        this prefill step asks for prompt logprobs): raw, as vLLM's."""
        if proc.prompt_next.shape[0] == 0:
            return proc.prompt_next[:, None]
        return logprob_info(self._lm(params, h), proc.prompt_next, self.n_top_logprobs)

    def _decode_loop(self, params, kv, inp: FlatInput, prev, steps: int, filtering):
        """``steps`` decode steps of N one-token rows (the decode family, T = N, no drafter),
        each token fed back on the device; host tokens -1 start from ``prev[:, -1]`` (the call
        before, not yet read). Same maths and RNG keys as ``steps`` one-step calls."""
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

    def _forward_impl(self, params, state: EngineState, ints, floats, prev, *, layout):
        """A split (structured) decode step's forward, chained behind ``prev``: the target over
        the step's tokens -> (state, the forward: logits f32[N, Q, V], and with a drafter the aux
        states and the continued input, what ``_tail_impl`` reads)."""
        self._compiling(("speculative" if self.K else "plain") + " split forward", layout)
        inp: FlatInput = self._unpack(ints, floats, layout)
        if self.K:
            inp = flat_spec.continue_flat(inp, prev, self.K, self.page_size, self.num_pages)
        else:
            inp = inp.replace(tokens=jnp.where(inp.tokens < 0, prev[:, -1], inp.tokens))
        h, aux, kv = self.model.apply({"params": params}, inp.tokens[None], inp.meta, state.kv,
                                      aux_layers=self.aux_layers)
        logits = self._lm(params, h[0][inp.logits_idx])
        return state.replace(kv=kv), ((logits, aux, inp) if self.K else logits)

    def _tail_impl(self, params, state: EngineState, dparams, rates, fwd, ints, floats, *, layout, filtering):
        """A split step's tail: masks (and sampling fields) the host built after reading the
        step before, sampling (and the drafter) on ``fwd``: the output of a one-step chained
        call, which the next call can chain behind."""
        self._compiling(("speculative" if self.K else "plain") + " split tail", layout)
        s: SampleInput = self._unpack(ints, floats, layout)
        if self.K == 0:
            out, lp = self._sample_one(fwd, s, s.proc, s.sample_pos, filtering)
            return state, (out if lp is None else (out, lp))
        logits, aux, inp = fwd
        return self._verify_and_propose(params, dparams, state, rates, logits, aux, inp, s, filtering)

    # ---- host side: building and running steps ----------------------------------------
    def shape_of(self, sched: SchedulerOutput, steps: int = 0, q: int | None = None) -> FlatShape:
        """``q``: a decode step's row width (default K + 1)."""
        if sched.kind == "decode":
            return self.shapes.decode_shape(len(sched.seqs), steps, q)
        return self.shapes.general_shape(sum(r.num_new for r in sched.seqs))

    def build(self, sched: SchedulerOutput, shape: FlatShape, **kw) -> FlatInput:
        return build_flat_input(sched, shape, self.shapes, page_size=self.page_size, num_pages=self.num_pages,
                                width=self.width, vocab_size=self.cfg.vocab_size, eos_token_ids=self.eos_token_ids,
                                prob_rows=self._prob_rows, **kw)

    def run(self, inp: FlatInput, steps: int = 0, prev: jax.Array | None = None):
        """One jitted step on a host-built input (two transfers), returned without waiting for
        the device (``_step_impl``'s out)."""
        self.state, out = self._invoke(*self._call(inp, steps, prev))
        return out

    def _invoke(self, name: str, args, kw):
        """Call the jitted function ``name`` here, and on a multi-host engine's other hosts
        first (``leader``: jspec/engine/mirror.py)."""
        if self.leader is None:
            return self._invoke_here(name, args, kw)
        if self.leader is mirror.CLOSED:
            raise RuntimeError("this engine over several nodes was closed: the other nodes no longer follow")
        cid = self.leader.before(self, name, args, kw)
        res = self._invoke_here(name, args, kw)
        self.leader.after(cid, res[1])
        return res

    def _invoke_here(self, name: str, args, kw):
        """The executable ``prepare`` made for these static arguments, else one made here:
        where ``compile_options`` adds options, lowered and compiled with them (and kept),
        else the jitted function itself (traced and compiled on first use)."""
        key = exe_key(name, kw)
        exe = self._executables.get(key)
        if exe is None and (options := self.compile_options(kw)) is not None:
            exe = self._executables[key] = getattr(self, name).lower(*args, **kw).compile(options)
        return exe(*args) if exe is not None else getattr(self, name)(*args, **kw)

    def compile_options(self, kw: dict) -> dict | None:
        """The XLA options a call's compile adds to its jitted function's: the plan's
        ``many_rows_xla_options`` for a step or forward of more than FP8_GEMM_MIN_ROWS tokens
        (``kw``: the call's static arguments), else None."""
        many = self.plan.many_rows_xla_options
        return dict(many) if many and layout_tokens(self._layouts[kw["layout"]]) > FP8_GEMM_MIN_ROWS else None

    def _no_prev_for(self, N: int, steps: int):
        """Zeros in the shape of the ``prev`` of a call chained behind ``steps`` fed-back decode
        steps, or a verification step: what an unchained fed-back call (and warmup) passes."""
        return self.no_prev((N, steps if self.K == 0 else 2 * self.K + 2))

    def no_prev(self, key: tuple[int, int]):
        if key not in self._no_prev:
            # numpy: a jnp.zeros of each new shape compiles a small program (warmup's main thread)
            self._no_prev[key] = replicate(jax.device_put(np.zeros(key, np.int32)), self.plan.mesh)
        return self._no_prev[key]

    def _call(self, inp: FlatInput, steps: int, prev, filtering: str | None = None):
        """(jitted function's name, arguments, static keywords) of ``run``'s call
        (``filtering``: the input's unless given)."""
        ints, floats, layout = pack(inp)
        if steps and prev is None:
            prev = self._no_prev_for(inp.sample.shape[0], steps)
        filtering = filtering or filtering_mode(self.cfg.vocab_size, inp)
        kw = dict(layout=self._layout_id(layout), steps=steps, filtering=filtering)
        args = (self.params, self.dparams, self.state, self.synthetic_rates, ints, floats, prev)
        return "_step", args, kw

    def dispatch(self, sched: SchedulerOutput, steps: int = 0, prev: jax.Array | None = None,
                 running: set | None = None, q: int | None = None):
        """Start a step over ``sched``'s rows; its output stays on the device until ``read``.
        steps = 0: one step fed by the host; steps >= 1 (decode rows): without a drafter that
        many decode steps each fed back, with one a verification step; either continues
        ``prev`` (the output of a call not yet read) when given. ``running``: the running
        request ids, for ``assign_prob_rows`` (a chained call keeps the rows of the call it
        continues). ``q``: a decode step's row width (dynamic speculation; default K + 1):
        a row verifies num_new - 1 <= q - 1 drafts (chained: the first of those ``prev``
        proposed); q = 1 verifies none and proposes none (the drafter's cache still takes the
        step's tokens)."""
        if prev is None:
            self.assign_prob_rows(sched, running or set())
            self.num_mixed_steps += sched.kind == "mixed"
        if steps == 0:
            return self.run(self.build(sched, self.shape_of(sched, 0, q)))
        prev = None if prev is None else tokens_of(prev)
        if self.K:
            return self.run(self.build(sched, self.shape_of(sched, 1, q), tokens_on_device=prev is not None), 1,
                            prev)
        inp = self.build(sched, self.shape_of(sched, steps), advance=0 if prev is None else prev.shape[1])
        return self.run(inp, steps, prev)

    def read(self, out, n: int, steps: int = 0, q: int | None = None) -> flat_spec.StepResult:
        """Wait for a step's output (``dispatch``'s, or ``dispatch_tail``'s with steps 1) and
        split its first n rows (``q`` = 1: a step of width 1 proposed nothing)."""
        if self.K:
            res = flat_spec.read_packed(out, n, self.K, self.n_top_logprobs)
            if q == 1:
                res.drafts = res.drafts[:, :0]
            return res
        tokens = host_copy(tokens_of(out))[:n]
        tokens = tokens[:, None] if tokens.ndim == 1 else tokens  # [n, 1], or [n, steps]
        res = flat_spec.StepResult(tokens, np.full((n,), tokens.shape[1], np.int32), np.zeros((n, 0), np.int32))
        if isinstance(out, tuple):
            lp = host_copy(out[1])[:n]
            res.logprobs = lp[:, None] if lp.ndim == 2 else lp
            if len(out) > 2:  # a one-step call: the prompt logprob blocks by segment
                res.prompt_logprobs = flat_spec.per_row(out[2], out[3], n)
        return res

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

    def dispatch_forward(self, sched: SchedulerOutput, prev) -> Split:
        """The forward of the decode step after ``prev`` (a call not yet read), dispatched
        before the host builds that step's masks (``dispatch_tail``): a structured batch's
        masks need ``prev``'s tokens (and drafts), which the host reads meanwhile."""
        prev = tokens_of(prev)
        if self.K:
            inp = self.build(sched, self.shape_of(sched, 1), tokens_on_device=True, forward_only=True)
        else:
            inp = self.build(sched, self.shape_of(sched, 1), advance=prev.shape[1], forward_only=True)
        return self.run_forward(inp, prev)

    def run_forward(self, inp: FlatInput, prev: jax.Array) -> Split:
        self.state, fwd = self._invoke(*self._forward_call(inp, prev))
        return Split(fwd, inp.sample.shape[0], self.K + 1, self.width * self.page_size)

    def _forward_call(self, inp: FlatInput, prev):
        ints, floats, layout = pack(inp)
        return "_fwd", (self.params, self.state, ints, floats, prev), dict(
            layout=self._layout_id(layout))

    def dispatch_tail(self, split: Split, sched: SchedulerOutput):
        """The rest of a split step from the host state now (the step before it read): each
        running row samples (verifying its grammar-valid drafts). The output is a one-step
        chained call's."""
        s = build_sample_input(sched, split, self.eos_token_ids, self.cfg.vocab_size)
        for i, r in enumerate(sched.seqs):
            s.prob_rows[i] = self._prob_rows.get(r.seq.request_id, 0)
        return self.run_tail(split, s)

    def run_tail(self, split: Split, s: SampleInput, filtering: str | None = None):
        self.state, out = self._invoke(*self._tail_call(split, s, filtering))
        return out

    def _tail_call(self, split: Split, s: SampleInput, filtering: str | None = None):
        ints, floats, layout = pack(s)
        return "_tail", (self.params, self.state, self.dparams, self.synthetic_rates, split.fwd, ints, floats), dict(
            layout=self._layout_id(layout), filtering=filtering or filtering_mode(self.cfg.vocab_size, s))

    # ---- the closed set of shapes -----------------------------------------------------
    def warmup_shapes(self, num_scheduler_steps: int = 1, async_scheduling: bool = False) -> list[FlatShape]:
        """Every shape a step can have: the general family, and the decode family as its
        decode steps run. Without a drafter: with async scheduling fed back one step per call
        (steps 1: every decode step, chained or not), ``num_scheduler_steps`` > 1 at a time,
        and the one-step host-fed call (steps 0) where a decode step is neither (async
        scheduling off, a batch that cannot grow ``num_scheduler_steps`` positions). With a
        drafter, num_scheduler_steps is 1: the verification step, chained or not."""
        multi = num_scheduler_steps > 1
        steps = ({0} if multi or not async_scheduling else set()) | ({num_scheduler_steps} if multi else set())
        steps |= {1} if async_scheduling else set()  # with num_scheduler_steps > 1: a batch with a grammar
        return self.shapes.all(tuple(sorted(steps)))


def exe_key(name: str, kw: dict) -> tuple:
    """The key of a prepared executable in ``FlatRunner._executables``: the jitted function's
    name and its static arguments (the other arguments' shapes follow from them)."""
    return (name, *sorted(kw.items()))
