"""The sampling half of the runner (jspec/engine/flat_runner.py's base): masks, processors,
sampling with no drafts and logprobs on the device; a split step's tail input built on the
host (``SampleInput``); the packed layouts the jitted steps take by index.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec import ops
from jspec.config import ModelConfig
from jspec.engine.logits_processing import ProcInput, apply_processors, build_proc_input, wants_processing
from jspec.engine.logprobs import logprob_info, sampler_logits
from jspec.engine.packing import unpack
from jspec.engine.scheduler import ScheduledSeq, SchedulerOutput
from jspec.engine.sequence import Status
from jspec.engine.structured import apply_bitmask, bitmask_words, build_bitmask
from jspec.kv_cache import KVCache
from jspec.models.transformer import Transformer
from jspec.ops import KernelPlan
from kernels_pallas.rejection_sampling import host_filtering

logger = logging.getLogger("jspec.engine")


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
        *,
        dtype,
        plan: KernelPlan,  # which kernels run (jspec.ops.plan_kernels)
    ):
        self.cfg = cfg
        self.params = params
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
    def _process(self, logits, inp, proc, drafts):
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
        out, n_emit = ops.rejection_sample(self.plan, logits, none, jnp.zeros((B,), jnp.int32), None, s.temperature,
                                           s.top_k, s.top_p, s.seeds, sample_pos, filtering=filtering)
        return out, n_emit, logits, raw

    def _token_logprobs(self, raw, processed, tokens, inp):
        """i32[B, Q, F] logprob blocks (jspec/engine/logprobs.py) of the emitted tokens i32[B, Q]."""
        src = raw if self.logprobs_mode == "raw_logprobs" else sampler_logits(
            processed, inp.temperature, inp.top_k, inp.top_p)
        return logprob_info(src, tokens, self.n_top_logprobs)

    # ---- the target's tables, for the drafters (the runner never names parameters) ----
    def embedding_table(self, params):
        """The target's input embedding [V, H]."""
        return self.model.apply({"params": params}, method=Transformer.embedding_table)

    def lm_head_weight(self, params):
        """The target's output projection, in the plan's layout."""
        return self.model.apply({"params": params}, method=Transformer.lm_head_weight)

    # ---- host side --------------------------------------------------------------------
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
