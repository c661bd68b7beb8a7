"""What both runners share: the step's input types, host rows -> padded device arrays
(``RunnerBase.build_input``), and the pieces both jitted steps call (processors, sampling
with no drafts, logprobs).

``ModelRunner`` (runner.py) adds the plain step and the fed-back decode call;
``SpecModelRunner`` (spec_runner.py) the speculative step. Neither inherits the other's jits.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
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
    wants_processing,
)
from jspec.engine.logprobs import logprob_info, sampler_logits
from jspec.engine.packing import unpack
from jspec.engine.scheduler import ScheduledSeq, SchedulerOutput
from jspec.engine.sequence import Status
from jspec.engine.structured import apply_bitmask, bitmask_words, build_bitmask
from jspec.kv_cache import AttentionMetadata, KVCache
from jspec.models.transformer import Transformer
from jspec.ops import KernelPlan
from kernels_pallas.rejection_sampling import host_filtering, rejection_sample

logger = logging.getLogger("jspec.engine")


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


@struct.dataclass
class SampleInput:
    """The host half of a split (structured) step's tail (``dispatch_tail``): what masking,
    sampling and proposing read, built once the step before it has been read. Same field
    names as StepInput's, which ``_process`` and ``_token_logprobs`` read."""

    temperature: jax.Array  # f32[B]
    top_k: jax.Array  # i32[B]
    top_p: jax.Array  # f32[B]
    seeds: jax.Array  # i32[B]
    sample_pos: jax.Array  # i32[B]
    num_draft: jax.Array  # i32[B]   drafts verified: the row's grammar-valid ones (speculation; 0 plain)
    sample: jax.Array  # bool[B]     rows still running (the others' output is dropped)
    prob_rows: jax.Array  # i32[B]   rows in probs_buf (speculation)
    proc: ProcInput | None
    grammar_mask: jax.Array | None  # i32[B, Q, ceil(V/32)]


class Split(NamedTuple):
    """A structured step whose forward is dispatched (``dispatch_forward``) and whose tail
    (masks, sampling, drafter) waits for the host: the forward's outputs stay on the device."""

    fwd: object  # device arrays the tail reads (the logits f32[B, Q, V], ...)
    batch: int  # B bucket
    q: int  # sampled positions per row: 1, or K + 1 when verifying
    hist: int  # history width of the processors (W * page_size)


class StepShape(NamedTuple):
    """One compiled shape of a runner's jitted step (``warmup_shapes``)."""

    batch: int  # B bucket
    q: int  # Q: tokens per row (1 decode, K + 1 verification, a prefill chunk bucket)
    pages: int  # W: page-table width bucket
    steps: int = 0  # ModelRunner: 0 the plain step, >= 1 a fed-back decode call of that many steps
    decode: bool = False  # a decode (or verification) step, not a prefill chunk
    prefill_rows: int = 0  # > 0: a mixed step, decode rows [batch, 1] + prefill chunks [prefill_rows, q]


def fold_seed(seed: int) -> int:
    s = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    return s - (1 << 32) if s >= (1 << 31) else s


def tokens_of(out):
    """The sampled tokens of a step's output (with processors: (tokens, logprob blocks))."""
    return out[0] if isinstance(out, tuple) else out


class RunnerBase:
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
        self.log_compiles = True  # each on first use (warmup says how many it compiled instead)
        # Packed layouts by index: the jitted steps take the small int as their static
        # argument, which is far cheaper to hash per call than the layout itself.
        self._layout_ids: dict = {}
        self._layouts: list = []

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
    def _process(self, logits, inp: StepInput, proc, drafts):
        """(logits for the sampler, raw logits): the processors applied when ``proc`` is given,
        after the grammar masks (vLLM's raw logprobs see them too)."""
        logits = apply_bitmask(logits, inp.grammar_mask)
        if proc is None:
            return logits, logits
        return apply_processors(logits, proc, drafts, inp.temperature), logits

    def _sample_no_drafts(self, logits, s, proc, sample_pos, filtering):
        """One token per row from logits f32[B, 1, V]: masks and processors (``proc``, may be
        None), then ``rejection_sample`` with no drafts at ``sample_pos`` (the RNG key's
        position) -> (tokens i32[B, 1], n_emit i32[B], the sampler's logits, the raw logits).
        Every plain step samples here (the one-call, fed-back, split and mixed steps) and so
        does a speculative prefill, for its first token."""
        B = logits.shape[0]
        none = jnp.zeros((B, 0), jnp.int32)
        logits, raw = self._process(logits, s, proc, none)
        out, n_emit = rejection_sample(logits, none, jnp.zeros((B,), jnp.int32), None, s.temperature, s.top_k,
                                       s.top_p, s.seeds, sample_pos, impl=self.sample_impl, filtering=filtering)
        return out, n_emit, logits, raw

    def _token_logprobs(self, raw, processed, tokens, inp: StepInput):
        """i32[B, Q, F] logprob blocks (jspec/engine/logprobs.py) of the emitted tokens i32[B, Q]."""
        src = raw if self.logprobs_mode == "raw_logprobs" else sampler_logits(
            processed, inp.temperature, inp.top_k, inp.top_p)
        return logprob_info(src, tokens, self.n_top_logprobs)

    def _prompt_logprobs(self, params, h, proc):
        """i32[B, P, F] logprob blocks of each query position's next prompt token (P = 0
        unless a row of this prefill step asks for prompt logprobs): raw, as vLLM's."""
        if proc.prompt_next.shape[1] == 0:
            return proc.prompt_next[..., None]
        logits = self.model.apply({"params": params}, h, method=Transformer.logits)  # f32[B, Q, V]
        return logprob_info(logits, proc.prompt_next, self.n_top_logprobs)

    # ---- the target's tables, for the drafters (the runner never names parameters) ----
    def embedding_table(self, params):
        """The target's input embedding [V, H]."""
        return self.model.apply({"params": params}, method=Transformer.embedding_table)

    def lm_head_weight(self, params):
        """The target's output projection, in the plan's layout."""
        return self.model.apply({"params": params}, method=Transformer.lm_head_weight)

    # ---- host side --------------------------------------------------------------------
    def chunk_q(self, sched: SchedulerOutput) -> int:
        """Q of a prefill step: the chunk bucket of its longest row."""
        return pick(self.buckets.prefill_q, max(r.num_new for r in sched.seqs))

    def build_input(self, sched: SchedulerOutput, Q: int, advance: int = 0,
                    tokens_on_device: bool = False, forward_only: bool = False,
                    B: int | None = None, W: int | None = None) -> tuple[StepInput, int]:
        """Pad the scheduled rows to buckets (B, W; ``Q`` is the runner's: 1 or K + 1 for a
        decode step, ``chunk_q`` for a prefill). Decode rows carry [last token, drafts...].

        ``advance`` > 0: a decode call chained behind one still running, which computes
        ``advance`` more positions per row first; its first token is not on the host yet
        (token -1: take it from the previous call's output on the device). ``B``, ``W``:
        given buckets (a mixed step's segments, jspec/engine/mixed.py).
        ``tokens_on_device``: every token is -1 (a speculative step chained behind the one
        that proposes them; the device also shifts the positions, see spec_runner).
        ``forward_only``: no processors or masks (a split step's forward: its tail has them)."""
        rows = sched.seqs
        n = len(rows)
        decode = sched.kind == "decode"
        B = B or pick(self.buckets.batch, n)
        W = W or pick(self.buckets.pages, max(len(r.seq.pages) for r in rows))
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
        proc = mask = None
        if not forward_only:
            if any(wants_processing(r.seq) for r in rows):
                proc = build_proc_input(rows, B, W * ps, Q, self.eos_token_ids, prefill=not decode and not advance)
            mask = build_bitmask(rows, B, Q if decode else 1, self.cfg.vocab_size,
                                 chained=bool(advance or tokens_on_device))
        return StepInput(tokens, meta, q_lens, temp, top_k, top_p, seeds, sample_pos, proc, mask), n

    def build_sample_input(self, sched: SchedulerOutput, split: Split) -> SampleInput:
        """The tail of a split decode step over ``sched``'s rows, from the host state after
        the step before it was read: each running row samples at num_computed + 1 (verifying
        its grammar-valid drafts, ``structured.advance``), under the masks of its grammar
        now; rows that stopped meanwhile sample nothing (mask: every token)."""
        B, Q = split.batch, split.q
        rows = [r if r.seq.status is Status.RUNNING else ScheduledSeq(r.seq, r.num_new, False) for r in sched.seqs]
        temp, top_p = np.zeros((B,), np.float32), np.ones((B,), np.float32)
        top_k, seeds, sample_pos, num_draft, prob_rows = (np.zeros((B,), np.int32) for _ in range(5))
        sample = np.zeros((B,), bool)
        for b, r in enumerate(rows):
            s, p = r.seq, r.seq.params
            temp[b], top_k[b], top_p[b], seeds[b] = p.temperature, max(p.top_k, 0), p.top_p, fold_seed(s.seed)
            sample_pos[b] = s.num_computed + 1
            num_draft[b] = min(len(s.draft_token_ids), Q - 1) if r.sample else 0
            sample[b] = r.sample
        proc = None
        if any(wants_processing(r.seq) for r in rows):
            proc = build_proc_input(rows, B, split.hist, Q, self.eos_token_ids, prefill=False)
        mask = build_bitmask(rows, B, Q, self.cfg.vocab_size)
        return SampleInput(temp, top_k, top_p, seeds, sample_pos, num_draft, sample, prob_rows, proc, mask)

    def precompile(self, shapes, threads: int):
        """Compile the executables ``warmup`` runs for ``shapes`` on ``threads`` threads first.

        Tracing and lowering hold the GIL (one shape at a time, here); XLA's compiler
        releases it, so the compilations overlap each other and the next shape's tracing.
        An 8B step takes seconds to compile on a GPU (the server's startup is mostly that).
        jax keeps an executable compiled ahead of time under the key a call looks up, so
        warmup's calls of the same arguments then only run. Shapes whose call this runner
        cannot lower ahead (``lower_shape`` -> None) compile in warmup as before. One
        thread: nothing to gain, warmup's calls compile as they go."""
        if threads <= 1:
            return
        with ThreadPoolExecutor(threads) as pool:
            jobs = [pool.submit(low.compile) for sh in shapes if (low := self.lower_shape(sh)) is not None]
            for job in jobs:
                job.result()

    def lower_shape(self, shape: StepShape):
        """The jitted call ``warmup`` makes for ``shape``, lowered (not compiled), or None."""
        return None

    def _filtering(self, *inps) -> str:
        """"on" when some request of the step (its inputs ``inps``: one, or a mixed step's
        two segments) uses top-k / top-p, else "off"."""
        modes = {host_filtering(i.temperature, i.top_k, i.top_p, self.cfg.vocab_size) for i in inps}
        return modes.pop() if len(modes) == 1 else ("on" if "on" in modes else "off")

    def allow_all(self, B: int, Q: int) -> np.ndarray:
        """Grammar masks i32[B, Q, ceil(V/32)] allowing every token (warmup's masked steps)."""
        return np.full((B, Q, bitmask_words(self.cfg.vocab_size)), -1, np.int32)

    def empty_sample_input(self, B: int, Q: int) -> SampleInput:
        """A split step's tail over B rows that sample nothing, masks allowing everything."""
        zi = np.zeros((B,), np.int32)
        return SampleInput(np.zeros((B,), np.float32), zi, np.ones((B,), np.float32), zi, zi, zi,
                           np.zeros((B,), bool), zi, None, self.allow_all(B, Q))

    def empty_input(self, B: int, Q: int, W: int) -> StepInput:
        """A step input of B empty rows (q_lens 0, every slot dropped): compiles a shape
        without touching the caches."""
        zi = lambda *s: np.zeros(s, np.int32)  # noqa: E731
        drop = self.num_pages * self.page_size
        meta = AttentionMetadata(zi(B, W), zi(B), zi(B, Q), np.full((B, Q), drop, np.int32), np.ones((B,), bool))
        return StepInput(zi(B, Q), meta, zi(B), np.zeros((B,), np.float32), zi(B), np.ones((B,), np.float32),
                         zi(B), zi(B))
