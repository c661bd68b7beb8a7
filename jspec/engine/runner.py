"""The one place where host bookkeeping becomes device arrays, and the jitted step.

``ModelRunner.execute`` turns a ``SchedulerOutput`` into a ``StepInput`` padded to a
bucket (batch B, query width Q, page-table width W), calls the jitted step with the KV
cache donated, and hands back per-sequence tokens. The number of distinct compiled shapes
is at most |batch buckets| x (|prefill buckets| + 1) x |page buckets|.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.config import ModelConfig
from jspec.engine.buckets import Buckets, pick
from jspec.engine.logits_processing import (
    ProcInput,
    apply_processors,
    build_proc_input,
    extend_history,
    wants_processing,
)
from jspec.engine.logprobs import logprob_info, sampler_logits
from jspec.engine.packing import pack, unpack
from jspec.engine.scheduler import SchedulerOutput
from jspec.engine.structured import apply_bitmask, build_bitmask
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.transformer import Transformer
from jspec.ops import KernelPlan
from kernels_pallas.rejection_sampling import host_filtering, rejection_sample


@struct.dataclass
class StepInput:
    tokens: jax.Array  # i32[B, Q]   uncomputed tokens of each sequence (padding: 0)
    meta: AttentionMetadata
    q_lens: jax.Array  # i32[B]      real tokens per row (0: empty batch slot)
    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    seeds: jax.Array  # i32[B]      request seed folded to 32 bits
    sample_pos: jax.Array  # i32[B]  position of the token being sampled (RNG key)
    # Logits processors and logprobs (jspec/engine/logits_processing.py); None when no row of
    # the step uses them: the step then compiles exactly as without them.
    proc: ProcInput | None = None
    # Structured outputs' packed token masks i32[B, Q', ceil(V/32)] (Q' = the sampled
    # positions: 1, or Q when verifying; jspec/engine/structured.py); None without grammars.
    grammar_mask: jax.Array | None = None


class StepShape(NamedTuple):
    """One compiled shape of a runner's jitted step (``warmup_shapes``)."""

    batch: int  # B bucket
    q: int  # Q: tokens per row (1 decode, K + 1 verification, a prefill chunk bucket)
    pages: int  # W: page-table width bucket
    steps: int = 0  # ModelRunner: 0 the plain step, >= 1 a fed-back decode call of that many steps
    decode: bool = False  # a decode (or verification) step, not a prefill chunk


def fold_seed(seed: int) -> int:
    s = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    return s - (1 << 32) if s >= (1 << 31) else s


def tokens_of(out):
    """The sampled tokens of a step's output (with processors: (tokens, logprob blocks))."""
    return out[0] if isinstance(out, tuple) else out


class ModelRunner:
    # Set by the engine (configure_sampling): what the processors and logprobs need.
    eos_token_ids: tuple = ()  # banned by min_tokens
    n_top_logprobs: int = 20  # top logprobs computed per token (EngineConfig.max_logprobs)
    logprobs_mode: str = "raw_logprobs"

    def configure_sampling(self, eos_token_ids, max_logprobs: int, logprobs_mode: str):
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.n_top_logprobs = self.cfg.vocab_size if max_logprobs == -1 else min(max_logprobs, self.cfg.vocab_size)
        self.logprobs_mode = logprobs_mode

    def __init__(
        self,
        cfg: ModelConfig,
        params,
        kv: KVCache,
        buckets: Buckets,
        *,
        dtype,
        plan: KernelPlan,  # which kernels run (jspec.ops.plan_kernels)
    ):
        self.cfg = cfg
        self.params = params
        self.kv = kv
        self.buckets = buckets
        self.page_size = kv.page_size
        self.num_pages = kv.num_pages
        self.plan = plan
        self.model = Transformer(cfg, dtype=dtype, plan=plan)
        self.sample_impl = plan.sample  # the rejection sampler's impl, read by the jitted steps
        self.num_compilations = 0  # traces of the step function (one per new shape)
        # `filtering` ("off" | "on": does any request use top-k / top-p) is decided on the
        # host per step: a device-side lax.cond would read its predicate on the host (a
        # ~50 us sync per step on the H200). Top-k / top-p traffic compiles a second variant.
        opts = plan.compiler_options
        self._step = jax.jit(self._step_impl, donate_argnums=(1,), static_argnames=("layout", "filtering"),
                             compiler_options=opts)
        self._multi = jax.jit(self._multi_step_impl, donate_argnums=(1,),
                              static_argnames=("layout", "steps", "filtering"), compiler_options=opts)
        # Packed layouts by index: the jitted steps take the small int as their static
        # argument, which is far cheaper to hash per call than the layout itself.
        self._layout_ids: dict = {}
        self._layouts: list = []
        self._no_prev: dict = {}  # (B, steps) -> zeros, the ``prev`` of an unchained decode call

    def _layout_id(self, layout) -> int:
        if layout not in self._layout_ids:
            self._layout_ids[layout] = len(self._layouts)
            self._layouts.append(layout)
        return self._layout_ids[layout]

    def _unpack(self, ints, floats, layout_id):
        return unpack(ints, floats, self._layouts[layout_id])

    # ---- device side ------------------------------------------------------------------
    def _process(self, logits, inp: StepInput, proc, drafts):
        """(logits for the sampler, raw logits): the processors applied when ``proc`` is given,
        after the grammar masks (vLLM's raw logprobs see them too)."""
        logits = apply_bitmask(logits, inp.grammar_mask)
        if proc is None:
            return logits, logits
        return apply_processors(logits, proc, drafts, inp.temperature), logits

    def _token_logprobs(self, raw, processed, tokens, inp: StepInput):
        """i32[B, Q, F] logprob blocks (jspec/engine/logprobs.py) of the emitted tokens i32[B, Q]."""
        src = raw if self.logprobs_mode == "raw_logprobs" else sampler_logits(
            processed, inp.temperature, inp.top_k, inp.top_p)
        return logprob_info(src, tokens, self.n_top_logprobs)

    def _step_impl(self, params, kv, ints, floats, *, layout, filtering):
        self.num_compilations += 1  # runs at trace time only
        inp: StepInput = self._unpack(ints, floats, layout)
        h, _, kv = self.model.apply({"params": params}, inp.tokens, inp.meta, kv)
        B = h.shape[0]
        last = h[jnp.arange(B), jnp.maximum(inp.q_lens - 1, 0)]  # [B, H]
        logits = self.model.apply({"params": params}, last, method=Transformer.logits)  # f32[B, V]
        logits, raw = self._process(logits[:, None, :], inp, inp.proc, jnp.zeros((B, 0), jnp.int32))
        tokens, _ = rejection_sample(
            logits,
            jnp.zeros((B, 0), jnp.int32),
            jnp.zeros((B,), jnp.int32),
            None,
            inp.temperature,
            inp.top_k,
            inp.top_p,
            inp.seeds,
            inp.sample_pos,
            impl=self.sample_impl,
            filtering=filtering,
        )
        if inp.proc is None:
            return kv, tokens[:, 0]
        return kv, (tokens[:, 0], self._token_logprobs(raw, logits, tokens, inp)[:, 0],
                    self._prompt_logprobs(params, h, inp.proc))

    def _prompt_logprobs(self, params, h, proc):
        """i32[B, P, F] logprob blocks of each query position's next prompt token (P = 0
        unless a row of this prefill step asks for prompt logprobs): raw, as vLLM's."""
        if proc.prompt_next.shape[1] == 0:
            return proc.prompt_next[..., None]
        logits = self.model.apply({"params": params}, h, method=Transformer.logits)  # f32[B, Q, V]
        return logprob_info(logits, proc.prompt_next, self.n_top_logprobs)

    def _multi_step_impl(self, params, kv, ints, floats, prev, *, layout, steps: int, filtering):
        """``steps`` decode steps in one call, each sampled token fed back on the device.

        Host bookkeeping (and its ~1 ms per step on the H200) is paid once per call. Same
        maths and RNG keys as ``steps`` single calls: step t samples at sample_pos + t.
        ``prev`` (i32[B, steps']) is the previous call's output, still on the device: a row
        whose host token is -1 starts from ``prev[b, -1]`` (async scheduling dispatches
        this call before the host has read that token).
        """
        self.num_compilations += 1
        inp: StepInput = self._unpack(ints, floats, layout)
        B = inp.tokens.shape[0]
        first = jnp.where(inp.tokens[:, 0] < 0, prev[:, -1], inp.tokens[:, 0])
        ps, drop = self.page_size, self.num_pages * self.page_size
        table = inp.meta.page_table
        active = inp.q_lens > 0
        none = (jnp.zeros((B, 0), jnp.int32), jnp.zeros((B,), jnp.int32), None)
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
            logits, raw = self._process(logits[:, None], inp, p, none[0])
            out, _ = rejection_sample(logits, *none, inp.temperature, inp.top_k, inp.top_p, inp.seeds,
                                      inp.sample_pos + t, impl=self.sample_impl, filtering=filtering)
            if proc is None:
                return (kv, out[:, 0], hist), out[:, 0]
            lp = self._token_logprobs(raw, logits, out, inp)[:, 0]
            hist = extend_history(*hist, out, active.astype(jnp.int32))
            return (kv, out[:, 0], hist), (out[:, 0], lp)

        (kv, _, _), ys = jax.lax.scan(body, (kv, first, hist), jnp.arange(steps, dtype=jnp.int32))
        if proc is None:
            return kv, ys.T  # i32[B, steps]
        return kv, (ys[0].T, ys[1].transpose(1, 0, 2))  # i32[B, steps], i32[B, steps, F]

    # ---- host side --------------------------------------------------------------------
    def build_input(self, sched: SchedulerOutput, q_override: int | None = None,
                    advance: int = 0, tokens_on_device: bool = False) -> tuple[StepInput, int]:
        """Pad the scheduled rows to buckets. Decode rows carry [last token, drafts...].

        ``advance`` > 0: a decode call chained behind one still running, which computes
        ``advance`` more positions per row first; its first token is not on the host yet
        (token -1: take it from the previous call's output on the device).
        ``tokens_on_device``: every token is -1 (a speculative step chained behind the one
        that proposes them; the device also shifts the positions, see spec_runner)."""
        rows = sched.seqs
        n = len(rows)
        decode = sched.kind == "decode"
        B = pick(self.buckets.batch, n)
        max_new = max(r.num_new for r in rows)
        Q = q_override or (1 if decode else pick(self.buckets.prefill_q, max_new))
        W = pick(self.buckets.pages, max(len(r.seq.pages) for r in rows))
        ps, drop = self.page_size, self.num_pages * self.page_size
        tokens = np.zeros((B, Q), np.int32)
        positions = np.zeros((B, Q), np.int32)
        slots = np.full((B, Q), drop, np.int32)
        table = np.zeros((B, W), np.int32)
        kv_lens = np.zeros((B,), np.int32)
        q_lens = np.zeros((B,), np.int32)
        temp = np.zeros((B,), np.float32)
        top_k = np.zeros((B,), np.int32)
        top_p = np.ones((B,), np.float32)
        seeds = np.zeros((B,), np.int32)
        sample_pos = np.zeros((B,), np.int32)
        for b, r in enumerate(rows):
            s, k = r.seq, r.num_new
            start = s.num_computed + advance
            pos = np.arange(start, start + k)
            pages = np.asarray(s.pages, np.int32)
            tokens[b, :k] = -1 if advance or tokens_on_device else s.tokens_between(start, start + k)
            positions[b, :k] = pos
            slots[b, :k] = pages[pos // ps] * ps + pos % ps
            table[b, : len(pages)] = pages
            kv_lens[b] = start + k
            q_lens[b] = k
            p = s.params
            temp[b] = p.temperature
            top_k[b] = p.top_k if p.top_k > 0 else 0
            top_p[b] = p.top_p
            seeds[b] = fold_seed(s.seed)
            # RNG key of the first sampled token: the position right after the last
            # committed token (verification emits tokens at sample_pos, sample_pos + 1, ...).
            sample_pos[b] = start + (1 if decode else k)
        meta = AttentionMetadata(
            page_table=table, kv_lens=kv_lens, positions=positions, slot_mapping=slots,
            causal=np.ones((B,), bool),
        )
        proc = None
        if any(wants_processing(r.seq) for r in rows):
            proc = build_proc_input(rows, B, W * ps, Q, self.eos_token_ids, prefill=not decode and not advance)
        mask = build_bitmask(rows, B, Q if decode else 1, self.cfg.vocab_size, chained=bool(advance or tokens_on_device))
        return StepInput(tokens, meta, q_lens, temp, top_k, top_p, seeds, sample_pos, proc, mask), n

    def _filtering(self, inp) -> str:
        """"on" when some request of the step uses top-k / top-p, else "off"."""
        return host_filtering(inp.temperature, inp.top_k, inp.top_p, self.cfg.vocab_size)

    def run(self, inp: StepInput, steps: int = 0, prev: jax.Array | None = None):
        """One jitted call on a host-built input (two transfers), returned without waiting
        for the device. ``steps`` = 0: the plain step, i32[B] sampled tokens; ``steps`` >= 1:
        that many decode steps fed back on the device (``_multi_step_impl``), i32[B, steps]."""
        ints, floats, layout = pack(inp)
        kw = dict(layout=self._layout_id(layout), filtering=self._filtering(inp))
        if steps == 0:
            self.kv, sampled = self._step(self.params, self.kv, ints, floats, **kw)
            return sampled
        if prev is None:
            key = (inp.tokens.shape[0], steps)
            if key not in self._no_prev:
                self._no_prev[key] = jnp.zeros(key, jnp.int32)
            prev = self._no_prev[key]
        self.kv, sampled = self._multi(self.params, self.kv, ints, floats, prev, steps=steps, **kw)
        return sampled

    def dispatch_decode(self, sched: SchedulerOutput, steps: int, prev: jax.Array | None = None) -> jax.Array:
        """Start ``steps`` fed-back decode steps; i32[B, steps] on the device (rows past the
        scheduled ones are padding). With ``prev`` (the output of a call not yet read) the
        call continues that one: positions start ``steps`` further, tokens from ``prev``."""
        prev = None if prev is None else tokens_of(prev)
        inp, _ = self.build_input(sched, advance=0 if prev is None else prev.shape[1])
        return self.run(inp, steps, prev)

    def execute(self, sched: SchedulerOutput):
        """Run one step; returns, per scheduled sequence, the tokens it emitted ([] if none),
        and with processors the logprob blocks i32[n, 1, F] of those tokens and i32[n, P, F]
        of the prompt tokens after each position (else None, None)."""
        inp, n = self.build_input(sched)
        out = self.run(inp)
        sampled = np.asarray(tokens_of(out))
        lp, plp = (np.asarray(out[1])[:n, None], np.asarray(out[2])[:n]) if isinstance(out, tuple) else (None, None)
        return [[int(sampled[i])] if sched.seqs[i].sample else [] for i in range(n)], lp, plp

    def warmup_shapes(self, num_scheduler_steps: int = 1, async_scheduling: bool = False) -> list[StepShape]:
        """Every shape the step may compile for: the bounded, known set (steps 0: the plain
        step; >= 1: the fed-back decode call, which with async scheduling and one step per
        call serves every decode step, so the plain Q = 1 step is never needed)."""
        plain_decode = num_scheduler_steps > 1 or not async_scheduling
        fed = num_scheduler_steps if num_scheduler_steps > 1 or async_scheduling else 0
        shapes = []
        for B in self.buckets.batch:
            for Q in ((1,) if plain_decode else ()) + self.buckets.prefill_q:
                shapes += [StepShape(B, Q, W, 0, decode=Q == 1) for W in self.buckets.pages]
            if fed:
                shapes += [StepShape(B, 1, W, fed, decode=True) for W in self.buckets.pages]
        return shapes

    def warmup(self, num_scheduler_steps: int = 1, async_scheduling: bool = False, shapes=None):
        """Compile every bucket (or ``shapes``, a subset of ``warmup_shapes``) with empty rows
        (all writes dropped: the cache is unchanged)."""
        for shape in shapes or self.warmup_shapes(num_scheduler_steps, async_scheduling):
            self.run(self.empty_input(shape.batch, shape.q, shape.pages), shape.steps)
        jax.block_until_ready(self.kv)

    def empty_input(self, B: int, Q: int, W: int) -> StepInput:
        """A step input of B empty rows (q_lens 0, every slot dropped): compiles a shape
        without touching the caches."""
        zi = lambda *s: np.zeros(s, np.int32)  # noqa: E731
        drop = self.num_pages * self.page_size
        meta = AttentionMetadata(zi(B, W), zi(B), zi(B, Q), np.full((B, Q), drop, np.int32), np.ones((B,), bool))
        return StepInput(zi(B, Q), meta, zi(B), np.zeros((B,), np.float32), zi(B), np.ones((B,), np.float32),
                         zi(B), zi(B))
