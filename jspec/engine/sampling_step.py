"""The sampling half of a step, as plain functions the runner (jspec/engine/flat_runner.py)
calls: masks, processors, sampling with no drafts and logprobs on the device; a split
step's tail input built on the host (``SampleInput``) and the other host-side pieces its
calls take (the filtering mode, masks allowing every token).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec import ops
from jspec.engine.logits_processing import ProcInput, apply_processors, build_proc_input, wants_processing
from jspec.engine.logprobs import logprob_info, sampler_logits
from jspec.engine.scheduler import ScheduledSeq, SchedulerOutput
from jspec.engine.sequence import Status
from jspec.engine.structured import apply_bitmask, bitmask_words, build_bitmask
from kernels_pallas.rejection_sampling import host_filtering


@struct.dataclass
class SampleInput:
    """The host half of a split (structured) step's tail (``FlatRunner.dispatch_tail``): what
    masking, sampling and proposing read, built once the step before it has been read. Same
    field names as FlatInput's, which ``process`` and ``token_logprobs`` read."""

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
    """A structured step whose forward is dispatched (``FlatRunner.dispatch_forward``) and
    whose tail (masks, sampling, drafter) waits for the host: the forward's outputs stay on
    the device."""

    fwd: object  # device arrays the tail reads (the logits f32[B, Q, V], ...)
    batch: int  # B bucket
    q: int  # sampled positions per row: 1, or K + 1 when verifying
    hist: int  # history width of the processors (W * page_size)


def fold_seed(seed: int) -> int:
    """A request's 64-bit seed folded into the i32 the RNG keys take."""
    s = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    return s - (1 << 32) if s >= (1 << 31) else s


def tokens_of(out):
    """The sampled tokens of a step's output (with processors: (tokens, logprob blocks))."""
    return out[0] if isinstance(out, tuple) else out


# ---- device side ----------------------------------------------------------------------
def process(logits, inp, proc, drafts):
    """(logits for the sampler, raw logits) from logits f32[B, Q, V]: ``inp``'s grammar masks
    (a FlatInput or SampleInput), then the processors when ``proc`` is given (vLLM's raw
    logprobs see the masks too). ``drafts`` i32[B, Q - 1]: position j sees those before it."""
    logits = apply_bitmask(logits, inp.grammar_mask)
    if proc is None:
        return logits, logits
    return apply_processors(logits, proc, drafts, inp.temperature), logits


def sample_no_drafts(plan, logits, s, proc, sample_pos, filtering):
    """One token per row from logits f32[B, 1, V]: masks and processors (``proc``, may be
    None), then ``ops.rejection_sample`` with no drafts at ``sample_pos`` (the RNG key's
    position), on the kernels of ``plan`` (a KernelPlan) -> (tokens i32[B, 1], n_emit i32[B], the
    sampler's logits, the raw logits). Every plain step samples here (the one-call, fed-back,
    split and mixed steps) and so does a speculative prefill, for its first token."""
    B = logits.shape[0]
    none = jnp.zeros((B, 0), jnp.int32)
    logits, raw = process(logits, s, proc, none)
    out, n_emit = ops.rejection_sample(plan, logits, none, jnp.zeros((B,), jnp.int32), None, s.temperature, s.top_k,
                                       s.top_p, s.seeds, sample_pos, filtering=filtering)
    return out, n_emit, logits, raw


def token_logprobs(raw, processed, tokens, inp, n_top_logprobs: int, logprobs_mode: str):
    """i32[B, Q, F] logprob blocks (jspec/engine/logprobs.py) of the emitted tokens i32[B, Q]:
    of the ``raw`` logits, or of what the sampler draws from (``processed`` under ``inp``'s
    temperature, top-k, top-p) as ``logprobs_mode`` says."""
    src = raw if logprobs_mode == "raw_logprobs" else sampler_logits(
        processed, inp.temperature, inp.top_k, inp.top_p)
    return logprob_info(src, tokens, n_top_logprobs)


# ---- host side ------------------------------------------------------------------------
def build_sample_input(sched: SchedulerOutput, split: Split, eos_token_ids, vocab_size: int) -> SampleInput:
    """The tail of a split decode step over ``sched``'s rows, from the host state after
    the step before it was read: each running row samples at num_computed + 1 (verifying
    its grammar-valid drafts, ``structured.advance``), under the masks of its grammar
    now; rows that stopped meanwhile sample nothing (mask: every token). ``prob_rows`` are
    left 0 for the runner to fill."""
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
        proc = build_proc_input(rows, B, split.hist, Q, eos_token_ids, prefill=False)
    mask = build_bitmask(rows, B, Q, vocab_size)
    return SampleInput(temp, top_k, top_p, seeds, sample_pos, num_draft, sample, prob_rows, proc, mask)


def filtering_mode(vocab_size: int, *inps) -> str:
    """"on" when some request of the step (its inputs ``inps``: FlatInput or SampleInput)
    uses top-k / top-p, else "off": the steps' static ``filtering`` argument."""
    modes = {host_filtering(i.temperature, i.top_k, i.top_p, vocab_size) for i in inps}
    return modes.pop() if len(modes) == 1 else ("on" if "on" in modes else "off")


def allow_all(B: int, Q: int, vocab_size: int) -> np.ndarray:
    """Grammar masks i32[B, Q, ceil(V/32)] allowing every token (warmup's masked steps)."""
    return np.full((B, Q, bitmask_words(vocab_size)), -1, np.int32)


def empty_sample_input(B: int, Q: int, vocab_size: int) -> SampleInput:
    """A split step's tail over B rows that sample nothing, masks allowing everything."""
    zi = np.zeros((B,), np.int32)
    return SampleInput(np.zeros((B,), np.float32), zi, np.ones((B,), np.float32), zi, zi, zi,
                       np.zeros((B,), bool), zi, None, allow_all(B, Q, vocab_size))
