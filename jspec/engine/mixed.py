"""The mixed step: decode rows and prefill chunks in one jitted call (plain engine; with a
drafter: spec_mixed.py).

A step of the mixed scheduler (``SchedulerOutput.kind == "mixed"``, scheduler.py) has two
row segments, each padded to its own buckets so neither pays for the other's width:
  decode segment   [Bd, 1]   every running decode row      (Bd: Buckets.batch)
  prefill segment  [Bp, Qp]  chunks of prefilling prompts  (Bp: Buckets.prefill_rows,
                                                              Qp: Buckets.mixed_q)
Both share one page-table width W, the widest bucket: under the GPU kernel the only one
(jspec.ops.page_table_widths); under the jnp reference a gather of every row's whole
table, which is what keeps the mixed shapes from multiplying by the width buckets there
(a bound of max_model_len keys per row; CPU serving is for tests). Device data flow (``MixedSteps._mixed_impl``):
  tokens [1, Bd + Bp * Qp]  (the segments flattened, decode first)
  Transformer(tokens, MixedMetadata((meta_d, meta_p)), kv)
    dense layers (qkv, o_proj, MLP, norms) over all N rows at once: weights stream once;
    the KV write scatters all N slots; attention runs once per segment on its own
    [B_i, Q_i] layout and metadata (jspec.ops.attention)
  last hidden per row: decode rows' only token, prefill rows' last chunk token
  logits = lm_head([Bd + Bp, H])  (one GEMM), split per segment
  per segment: grammar masks, processors, rejection_sample (K = 0), logprobs (runner._sample);
  masks come for both segments or neither (``masked_alike``): one masked variant per shape
  -> (out_d, out_p): i32[Bd], i32[Bp] (with processors, tuples with logprob blocks)
A prefill row that does not reach its last prompt token samples too; the host drops it.

Shapes: |batch| x |prefill_rows| x |mixed_q| mixed steps (``mixed_shapes``),
besides the runner's prefill (rows up to prefill_rows) and decode shapes.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jspec.engine.buckets import pick
from jspec.engine.packing import pack
from jspec.engine.runner_base import StepInput, StepShape
from jspec.engine.scheduler import SchedulerOutput
from jspec.kv_cache import MixedMetadata
from jspec.models.transformer import Transformer


@struct.dataclass
class MixedInput:
    decode: StepInput  # rows [Bd, 1]
    prefill: StepInput  # rows [Bp, Qp]


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


def describe_shapes(shapes) -> str:
    """One line for the server's startup log: how many shapes warmup compiles, by kind."""
    kinds = collections.Counter("mixed" if s.prefill_rows else ("decode" if s.decode else "prefill")
                                for s in shapes)
    return f"{len(shapes)} shapes (" + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")"


class MixedSteps:
    """ModelRunner's mixed step (a mixin over RunnerBase)."""

    num_mixed_steps = 0  # mixed steps run (engine stats)

    def _mixed_impl(self, params, kv, ints, floats, *, layout, filtering):
        self._compiling("mixed", layout)  # runs at trace time only
        inp: MixedInput = self._unpack(ints, floats, layout)
        d, p = inp.decode, inp.prefill
        (Bd, Qd), (Bp, Qp) = d.tokens.shape, p.tokens.shape
        tokens = jnp.concatenate([d.tokens.reshape(1, -1), p.tokens.reshape(1, -1)], axis=1)
        h, _, kv = self.model.apply({"params": params}, tokens, MixedMetadata((d.meta, p.meta)), kv)
        hd = h[0, : Bd * Qd].reshape(Bd, Qd, -1)
        hp = h[0, Bd * Qd :].reshape(Bp, Qp, -1)
        last = jnp.concatenate([hd[:, 0], hp[jnp.arange(Bp), jnp.maximum(p.q_lens - 1, 0)]], axis=0)
        logits = self.model.apply({"params": params}, last, method=Transformer.logits)  # f32[Bd + Bp, V]
        return kv, (self._sample(params, hd, logits[:Bd], d, filtering),
                    self._sample(params, hp, logits[Bd:], p, filtering))

    def build_mixed_input(self, sched: SchedulerOutput) -> MixedInput:
        nd = sched.num_decode
        dec = SchedulerOutput("decode", sched.seqs[:nd], [])
        pre = SchedulerOutput("prefill", sched.seqs[nd:], [])
        b = self.buckets
        W = b.pages[-1]
        d, _ = self.build_input(dec, 1, W=W)
        p, _ = self.build_input(pre, pick(b.mixed_q, max(r.num_new for r in pre.seqs)),
                                B=pick(b.prefill_rows, len(pre.seqs)), W=W)
        return MixedInput(*masked_alike(d, 1, p, 1, self.allow_all))

    def run_mixed(self, inp: MixedInput):
        """One jitted mixed call (two transfers), not waited for: (out_d, out_p)."""
        fn, args, kw = self._mixed_call(inp)
        self.kv, out = fn(*args, **kw)
        return out

    def _mixed_call(self, inp: MixedInput):
        """(jitted function, arguments, static keywords) of ``run_mixed``'s call."""
        ints, floats, layout = pack(inp)
        return self._mixed, (self.params, self.kv, ints, floats), dict(layout=self._layout_id(layout),
                                                                      filtering=self._filtering(inp.decode, inp.prefill))

    def execute_mixed(self, sched: SchedulerOutput):
        """``ModelRunner.execute`` of a mixed step: per row the tokens it emitted, the logprob
        blocks i32[n, 1, F] and prompt logprob blocks i32[n, P, F] (None without processors;
        rows of a segment without processors hold zeros, which no request reads)."""
        nd, n = sched.num_decode, len(sched.seqs)
        outs = self.run_mixed(self.build_mixed_input(sched))
        self.num_mixed_steps += 1
        segs = [(outs[0], 0, nd), (outs[1], nd, n)]
        tokens = np.concatenate([np.asarray(o[0] if isinstance(o, tuple) else o)[: hi - lo] for o, lo, hi in segs])
        toks = [[int(tokens[i])] if sched.seqs[i].sample else [] for i in range(n)]
        with_proc = [(np.asarray(o[1]), np.asarray(o[2]), lo, hi) for o, lo, hi in segs if isinstance(o, tuple)]
        if not with_proc:
            return toks, None, None
        F = with_proc[0][0].shape[-1]
        P = max(plp.shape[1] for _, plp, _, _ in with_proc)
        lp, plp = np.zeros((n, 1, F), np.int32), np.zeros((n, P, F), np.int32)
        for blocks, pblocks, lo, hi in with_proc:
            lp[lo:hi, 0] = blocks[: hi - lo]
            plp[lo:hi, : pblocks.shape[1]] = pblocks[: hi - lo]
        return toks, lp, plp

    def empty_mixed_input(self, shape: StepShape, masked: bool = False) -> MixedInput:
        """A mixed step of ``shape`` with no active row (``masked``: with grammar masks)."""
        d = self.empty_input(shape.batch, 1, shape.pages)
        p = self.empty_input(shape.prefill_rows, shape.q, shape.pages)
        if masked:
            d, p = (s.replace(grammar_mask=self.allow_all(s.tokens.shape[0], 1)) for s in (d, p))
        return MixedInput(d, p)

    def warmup_mixed(self, shapes, masked: bool = False):
        for shape in shapes:
            self.run_mixed(self.empty_mixed_input(shape, masked))
        jax.block_until_ready(self.kv)
