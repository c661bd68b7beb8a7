"""The speculative mixed step: verification rows and prefill chunks in one jitted call.

A step of the mixed scheduler
(``SchedulerOutput.kind == "mixed"``) has two row segments, each padded to its own buckets:
  decode segment   [Bd, K + 1]  every running row: last token + its drafts  (Bd: Buckets.batch)
  prefill segment  [Bp, Qp]     chunks of prefilling prompts  (Bp: Buckets.prefill_rows,
                                                                Qp: Buckets.mixed_q)
Both share the widest page-table width (as the plain mixed step). Device data flow
(``SpecMixedSteps._spec_mixed_impl``):
  tokens [1, Bd (K+1) + Bp Qp]  (the segments flattened, decode first)
  Transformer(tokens, MixedMetadata((meta_d, meta_p)), kv, aux_layers): ONE target forward,
    dense layers over all rows (weights stream once), attention per segment
  logits = lm_head([Bd (K+1) + Bp, H])  (every verified position, each chunk's last token)
  decode segment:  _verify_and_propose, as a verification step (rejection sampling, drafter)
  prefill segment: _prefill_and_propose, as a prefill step (sample at the last chunk token,
                   drafter over the shifted prompt -> the first drafts)
  the drafter's cache and the draft-probability buffer pass through both proposes in turn,
  the prefill segment's writes made to depend on the decode segment's drafts (``after``)
  -> (packed_d i32[Bd, ...], packed_p i32[Bp, ...]), each a speculative step's packed output
The host reads both and merges them in the scheduled row order (``execute_spec_mixed``).
A mixed step is not chained behind another (LLMEngine: a prefilling request already stops
async chaining); decode-only steps keep the chained verification call.

Shapes: ``mixed_shapes`` (|batch| x |prefill_rows| x |mixed_q|, Q = K + 1 implied for the
decode segment), besides the runner's verification and prefill shapes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.engine.buckets import pick
from jspec.engine.packing import pack
from jspec.engine.runner_base import StepInput, StepShape
from jspec.engine.scheduler import SchedulerOutput
from jspec.kv_cache import MixedMetadata


def mixed_shapes(buckets) -> list[StepShape]:
    """Every mixed-step shape of these buckets (none when the engine does not mix)."""
    return [StepShape(Bd, Qp, buckets.pages[-1], 0, prefill_rows=Bp) for Bd in buckets.batch
            for Bp in buckets.prefill_rows for Qp in buckets.mixed_q]


def masked_alike(a: StepInput, qa: int, b: StepInput, qb: int, allow_all):
    """Both segments with grammar masks, or neither: where only one segment has a grammar,
    the other gets masks allowing every token (``allow_all(B, Q)``; qa, qb: each segment's
    mask positions). So a mixed shape has one masked variant, the one warmup compiles."""
    if (a.grammar_mask is None) == (b.grammar_mask is None):
        return a, b

    def fill(s, q):
        return s if s.grammar_mask is not None else s.replace(grammar_mask=allow_all(s.tokens.shape[0], q))

    return fill(a, qa), fill(b, qb)


@struct.dataclass
class SpecMixedInput:
    decode: object  # SpecInput, rows [Bd, K + 1]
    prefill: object  # SpecInput, rows [Bp, Qp]


def merge_results(a, b):
    """One SpecStepResult of a's rows then b's (logprob blocks zero where a segment had none,
    which no request reads; prompt logprob blocks padded to the wider)."""

    def cat(x, y, n_x, n_y):
        if x is None and y is None:
            return None
        ref = x if x is not None else y
        width = max(z.shape[1] for z in (x, y) if z is not None)
        out = np.zeros((n_x + n_y, width, *ref.shape[2:]), ref.dtype)
        for z, lo, n in ((x, 0, n_x), (y, n_x, n_y)):
            if z is not None:
                out[lo : lo + n, : z.shape[1]] = z
        return out

    na, nb = len(a.num_emitted), len(b.num_emitted)
    return dataclasses.replace(
        a,
        tokens=np.concatenate([a.tokens, b.tokens]),
        num_emitted=np.concatenate([a.num_emitted, b.num_emitted]),
        drafts=np.concatenate([a.drafts, b.drafts]),
        logprobs=cat(a.logprobs, b.logprobs, na, nb),
        prompt_logprobs=cat(a.prompt_logprobs, b.prompt_logprobs, na, nb),
    )


def after(inp, draft):
    """``inp`` (the prefill segment's SpecInput) made to depend on ``draft`` (i32[], the
    decode segment's last draft of row 0: it depends on every drafter read of that segment).
    The prefill segment's drafter and probs_buf writes need nothing the decode segment
    computed, so XLA may order them before the decode segment's reads of the same buffers,
    and keep those reads valid by copying the donated buffers (a temporary as large as a
    drafter layer's cache; an optimization barrier does not prevent it). A data dependency
    does: the write indices' sources pass through a select that is never taken (a draft is a
    token id, never INT32_MIN)."""
    never = draft == jnp.iinfo(jnp.int32).min
    b = inp.base
    meta = b.meta.replace(
        page_table=jnp.where(never, 0, b.meta.page_table), slot_mapping=jnp.where(never, 0, b.meta.slot_mapping)
    )
    return inp.replace(base=b.replace(meta=meta), prob_rows=jnp.where(never, 0, inp.prob_rows))


class SpecMixedSteps:
    """SpecModelRunner's mixed step (a mixin over RunnerBase)."""

    num_mixed_steps = 0  # mixed steps run (engine stats)

    def _spec_mixed_impl(
        self, params, dparams, kv, dkv, probs_buf, synthetic_rates, ints, floats, *, layout, filtering
    ):
        self._compiling("speculative mixed", layout)  # runs at trace time only
        inp: SpecMixedInput = self._unpack(ints, floats, layout)
        d, p = inp.decode.base, inp.prefill.base
        (Bd, Qd), (Bp, Qp) = d.tokens.shape, p.tokens.shape
        nd = Bd * Qd
        tokens = jnp.concatenate([d.tokens.reshape(1, -1), p.tokens.reshape(1, -1)], axis=1)
        h, aux, kv = self.model.apply(
            {"params": params}, tokens, MixedMetadata((d.meta, p.meta)), kv, aux_layers=self.aux_layers
        )
        hd, hp = h[0, :nd].reshape(Bd, Qd, -1), h[0, nd:].reshape(Bp, Qp, -1)
        aux_d, aux_p = (None, None) if aux is None else (aux[0, :nd].reshape(Bd, Qd, -1),
                                                          aux[0, nd:].reshape(Bp, Qp, -1))
        last_p = hp[jnp.arange(Bp), jnp.maximum(p.q_lens - 1, 0)]
        logits = self._lm(params, jnp.concatenate([hd.reshape(nd, -1), last_p], axis=0))  # one GEMM
        dkv, probs_buf, out_d = self._verify_and_propose(
            params,
            dparams,
            dkv,
            probs_buf,
            synthetic_rates,
            logits[:nd].reshape(Bd, Qd, -1),
            aux_d,
            d.tokens,
            d.meta,
            inp.decode,
            d,
            filtering,
            hd,
        )
        dkv, probs_buf, out_p = self._prefill_and_propose(
            params,
            dparams,
            dkv,
            probs_buf,
            logits[nd:],
            hp,
            aux_p,
            after(inp.prefill, out_d[0, 2 * self.K + 1]),
            filtering,
        )
        return kv, dkv, probs_buf, (out_d, out_p)

    # ---- host side --------------------------------------------------------------------
    def build_spec_mixed_input(self, sched: SchedulerOutput) -> SpecMixedInput:
        nd = sched.num_decode
        b = self.buckets
        W = b.pages[-1]
        d, _, _ = self.build_spec_input(SchedulerOutput("decode", sched.seqs[:nd], []), W=W)
        pre = SchedulerOutput("prefill", sched.seqs[nd:], [])
        p, _, _ = self.build_spec_input(
            pre, B=pick(b.prefill_rows, len(pre.seqs)), W=W, Q=pick(b.mixed_q, max(r.num_new for r in pre.seqs))
        )
        bd, bp = masked_alike(d.base, self.K + 1, p.base, 1, self.allow_all)
        return SpecMixedInput(d.replace(base=bd), p.replace(base=bp))

    def run_spec_mixed(self, inp: SpecMixedInput):
        """One jitted mixed call (two transfers), not waited for: (packed_d, packed_p)."""
        args, kw = self._spec_mixed_args(inp)
        self.kv, self.dkv, self.probs_buf, out = self._spec_mixed(*args, **kw)
        return out

    def _spec_mixed_args(self, inp: SpecMixedInput):
        """(arguments, static keywords) of the mixed call on ``inp``."""
        ints, floats, layout = pack(inp)
        args = (self.params, self.dparams, self.kv, self.dkv, self.probs_buf, self.synthetic_rates, ints, floats)
        return args, dict(layout=self._layout_id(layout), filtering=self._filtering(inp.decode.base, inp.prefill.base))

    def execute_spec_mixed(self, sched: SchedulerOutput):
        """A mixed step, read: one SpecStepResult over ``sched``'s rows (decode rows first)."""
        nd = sched.num_decode
        out_d, out_p = self.run_spec_mixed(self.build_spec_mixed_input(sched))
        self.num_mixed_steps += 1
        return merge_results(self.read_spec(out_d, nd), self.read_spec(out_p, len(sched.seqs) - nd))

    def empty_spec_mixed_input(self, sh: StepShape, masked: bool = False) -> SpecMixedInput:
        """A mixed step of shape ``sh`` with no active row (``masked``: with grammar masks)."""
        d = self.empty_spec_input(StepShape(sh.batch, self.K + 1, sh.pages, decode=True))
        p = self.empty_spec_input(StepShape(sh.prefill_rows, sh.q, sh.pages))
        if masked:
            d = d.replace(base=d.base.replace(grammar_mask=self.allow_all(sh.batch, self.K + 1)))
            p = p.replace(base=p.base.replace(grammar_mask=self.allow_all(sh.prefill_rows, 1)))
        return SpecMixedInput(d, p)

    def lower_spec_mixed(self, sh: StepShape):
        """The mixed step of shape ``sh``, lowered (not run), as ``lower_spec``."""
        args, kw = self._spec_mixed_args(self.empty_spec_mixed_input(sh))
        return self._spec_mixed.lower(*args, **kw)

    def warmup_spec_mixed(self, shapes, masked: bool = False):
        for sh in shapes:
            self.run_spec_mixed(self.empty_spec_mixed_input(sh, masked))
        jax.block_until_ready((self.kv, self.dkv))
