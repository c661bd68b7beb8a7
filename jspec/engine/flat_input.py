"""A step's rows as one flat token batch (vLLM V1's layout), built on the host.

Every scheduled row contributes one contiguous segment of the step's T tokens: a prefill
chunk, or a decode row's last token followed by its drafts (K + 1 tokens to verify; 1
without speculation). Segment i is tokens[cu_q_lens[i] : cu_q_lens[i + 1]]; N sequence
slots, ``num_seqs`` of them used. Shapes come from two families of buckets
(``FlatShapes``), so the set a server compiles is closed and known at startup:
  decode   every row a decode row of the same width Q: N from the batch buckets, T = N * Q;
           a chained call (async scheduling) continues such a step on the device. With
           dynamic speculation (jspec/engine/dynamic_spec.py) one family per width Q in
           ``FlatShapes.widths``: 1 (speculation off: no drafter), K + 1, and widths between
  general  any mix of prefill chunks and decode rows: T from the token buckets, N = the
           batch bucket of min(T, max_num_seqs)
A decode step's rows take Q tokens each (row i from i * Q; a row with fewer drafts ends in
padding), so its attention runs as paged attention over [N, Q] rows with the kernels tuned
for decode and verification (RaggedMetadata.uniform); a general step's segments are packed.
The page table is always the whole width (max_model_len's pages): the kernels stop at each
sequence's kv_len, so one width serves every context.

Sampled positions: ``logits_idx`` i32[N, Q] holds the flat index of each position whose
logits are sampled: a decode row's Q positions (its last token, then each draft: position
j predicts the token after d_j), a prefill row's last chunk token (position 0 only).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np
from flax import struct

from jspec.engine.buckets import pick, pow2_buckets
from jspec.engine.logits_processing import ProcInput, build_proc_input, wants_processing
from jspec.engine.sampling_step import fold_seed
from jspec.engine.scheduler import SchedulerOutput
from jspec.engine.structured import build_bitmask
from jspec.kv_cache import RaggedMetadata


@struct.dataclass
class FlatInput:
    tokens: jax.Array  # i32[T]          segment tokens (-1: from the previous call, on the device)
    meta: RaggedMetadata  # positions / slot_mapping [1, T], per-sequence metadata [N]
    logits_idx: jax.Array  # i32[N, Q]   flat index of each sampled position (padding: the row's first)
    num_draft: jax.Array  # i32[N]       drafts a decode row verifies (0: plain decode, prefill)
    sample: jax.Array  # bool[N]         the row samples (its segment ends at its last token)
    temperature: jax.Array  # f32[N]
    top_k: jax.Array  # i32[N]
    top_p: jax.Array  # f32[N]
    seeds: jax.Array  # i32[N]           request seed folded to 32 bits
    sample_pos: jax.Array  # i32[N]      position of the first sampled token (its RNG key)
    # The drafter's pairs (speculation; jspec/drafters/propose.py): the pair at token t is the
    # token at position + 1: out.reshape(-1)[pair_src[t]] when pair_src[t] >= 0 (a decode
    # row's emitted tokens; a prefill row's sampled one at its last chunk token), else
    # pair_next[t] (the prompt's next token, known on the host).
    pair_src: jax.Array  # i32[T]
    pair_next: jax.Array  # i32[T]
    prob_rows: jax.Array  # i32[N]       row of each request in the draft-probability buffer
    # Processors and logprobs (logits_processing.py; per sequence [N], prompt_next per
    # token [T] or [0]); None when no row uses them: the step compiles as without them.
    proc: ProcInput | None = None
    grammar_mask: jax.Array | None = None  # i32[N, Q, ceil(V/32)] structured outputs (structured.py)


class FlatShape(tuple):
    """One compiled program: (tokens T, sequences N, steps, decode, filtering). steps >= 1: a
    decode step fed from the previous call on the device (async scheduling's), that many
    steps; filtering "on": some row uses top-k / top-p (the sort over the vocabulary)."""

    __slots__ = ()

    def __new__(cls, tokens: int, seqs: int, steps: int = 0, decode: bool = False, filtering: str = "off"):
        return super().__new__(cls, (tokens, seqs, steps, decode, filtering))

    tokens = property(lambda s: s[0])
    seqs = property(lambda s: s[1])
    steps = property(lambda s: s[2])
    decode = property(lambda s: s[3])
    filtering = property(lambda s: s[4])


@dataclasses.dataclass(frozen=True)
class FlatShapes:
    """The bucket families of a runner (module docstring)."""

    batch: tuple[int, ...]  # N buckets: powers of two up to max_num_seqs
    tokens: tuple[int, ...]  # T buckets of general steps
    q: int  # a general step's row width: K + 1 (1 without speculation)
    max_chunk: int  # longest prefill segment
    widths: tuple[int, ...] = ()  # decode row widths (dynamic speculation); () means (q,)

    @classmethod
    def create(cls, max_num_seqs: int, max_num_batched_tokens: int, max_prefill_chunk: int, q: int,
               widths: tuple[int, ...] = ()):
        lo = min(8, max_num_batched_tokens)
        return cls(pow2_buckets(1, max_num_seqs), pow2_buckets(lo, max_num_batched_tokens), q,
                   max_prefill_chunk, tuple(widths))

    @property
    def decode_widths(self) -> tuple[int, ...]:
        return self.widths or (self.q,)

    def decode_shape(self, n: int, steps: int = 0, q: int | None = None) -> FlatShape:
        """The decode program of n rows of width ``q`` (default: K + 1)."""
        N = pick(self.batch, n)
        return FlatShape(N * (q or self.q), N, steps, True)

    def general_shape(self, num_tokens: int) -> FlatShape:
        T = pick(self.tokens, num_tokens)
        return FlatShape(T, pick(self.batch, min(T, self.batch[-1])))

    def all(self, decode_steps: tuple[int, ...] = (0,)) -> list[FlatShape]:
        """Every program: the decode family for each ``decode_steps`` (0: one host-fed step),
        then the general family, each without and with top-k / top-p filtering."""
        shapes = [self.decode_shape(n, s, q) for q in self.decode_widths for s in decode_steps for n in self.batch]
        shapes += [self.general_shape(t) for t in self.tokens]
        return [FlatShape(*s[:4], f) for f in ("off", "on") for s in shapes]

    def windows(self, shape: FlatShape) -> tuple[int, int]:
        """The query windows of the XLA attention path (RaggedMetadata.windows)."""
        if shape.decode:
            return (row_width(shape),) * 2
        return (self.q, min(shape.tokens, max(self.max_chunk, self.q)))


def row_width(shape: FlatShape) -> int:
    """A decode program's row width Q (T = N * Q)."""
    return shape.tokens // shape.seqs


def build_flat_input(sched: SchedulerOutput, shape: FlatShape, shapes: FlatShapes, *, page_size: int, num_pages: int,
                     width: int, vocab_size: int, eos_token_ids, advance: int = 0, tokens_on_device: bool = False,
                     forward_only: bool = False, prob_rows: dict | None = None) -> FlatInput:
    """The flat input of ``sched``'s rows in ``shape`` (decode rows first, as scheduled).

    ``advance`` > 0: a decode call chained behind one not yet read, which computes that many
    positions per row first (its tokens come from that call's output: host token -1).
    ``tokens_on_device``: every token is -1 (a speculative step chained behind the one that
    proposed them). ``forward_only``: no processors or masks (a split step's forward).
    ``prob_rows``: request id -> its row of the draft-probability buffer."""
    T, N = shape.tokens, shape.seqs
    Q = row_width(shape) if shape.decode else shapes.q
    rows = sched.seqs
    n_dec = len(rows) if sched.kind == "decode" else sched.num_decode
    drop = num_pages * page_size
    tokens = np.zeros((T,), np.int32)
    positions = np.zeros((1, T), np.int32)
    slots = np.full((1, T), drop, np.int32)
    cu = np.zeros((N + 1,), np.int32)
    kv_lens = np.zeros((N,), np.int32)
    table = np.zeros((N, width), np.int32)
    logits_idx = np.zeros((N, Q), np.int32)
    num_draft = np.zeros((N,), np.int32)
    sample = np.zeros((N,), bool)
    temp, top_p = np.zeros((N,), np.float32), np.ones((N,), np.float32)
    top_k, seeds, sample_pos, rows_p = (np.zeros((N,), np.int32) for _ in range(4))
    pair_src = np.full((T,), -1, np.int32)
    pair_next = np.zeros((T,), np.int32)
    off = 0
    for i, r in enumerate(rows):
        s, k = r.seq, r.num_new
        decode = i < n_dec
        start = s.num_computed + advance
        pos = np.arange(start, start + k)
        pages = np.asarray(s.pages, np.int32)
        if shape.decode:  # rows of Q tokens: a shorter row's last ones are padding, at positions past it
            off = i * Q
            positions[0, off : off + Q] = np.arange(start, start + Q)
        tokens[off : off + k] = -1 if advance or tokens_on_device else s.tokens_between(start, start + k)
        positions[0, off : off + k] = pos
        slots[0, off : off + k] = pages[pos // page_size] * page_size + pos % page_size
        table[i, : len(pages)] = pages
        kv_lens[i] = start + k
        logits_idx[i] = off + (np.minimum(np.arange(Q), k - 1) if decode else k - 1)
        num_draft[i] = k - 1 if decode else 0
        if decode:  # pair j: the token emitted at position j
            pair_src[off : off + k] = i * Q + np.arange(k)
        else:  # the prompt one on, and at the prompt's last token the sampled one
            nxt = s.tokens_between(start + 1, start + 1 + k)
            pair_next[off : off + len(nxt)] = nxt
            if r.sample:
                pair_src[off + k - 1] = i * Q
        rows_p[i] = (prob_rows or {}).get(s.request_id, 0)
        sample[i] = r.sample
        p = s.params
        temp[i], top_k[i], top_p[i] = p.temperature, max(p.top_k, 0), p.top_p
        seeds[i] = fold_seed(s.seed)
        sample_pos[i] = start + (1 if decode else k)  # the position right after the last committed token
        off += k
        cu[i + 1] = off
    cu[len(rows) + 1 :] = off
    if shape.decode:
        cu = np.arange(N + 1, dtype=np.int32) * Q
    meta = RaggedMetadata(positions, slots, cu, kv_lens, table, np.array([len(rows)], np.int32),
                          np.ones((N,), bool), shapes.windows(shape), Q if shape.decode else 0)
    proc = mask = None
    if not forward_only:
        if any(wants_processing(r.seq) for r in rows):
            proc = flat_proc_input(sched, n_dec, N, width * page_size, Q, T, eos_token_ids, prefill=not advance)
        mask = build_bitmask(rows, N, Q, vocab_size, chained=bool(advance or tokens_on_device))
    return FlatInput(tokens, meta, logits_idx, num_draft, sample, temp, top_k, top_p, seeds, sample_pos, pair_src,
                     pair_next, rows_p, proc, mask)


def flat_proc_input(sched, n_dec: int, N: int, hist: int, Q: int, T: int, eos_token_ids, prefill: bool) -> ProcInput:
    """The processors' input of a flat step: per sequence, as a [B, Q] step's, but the
    prompt tokens whose logprobs are asked for per flat token ([T], or [0] when no row of
    a prefill step asks)."""
    rows = sched.seqs
    proc = build_proc_input(rows, N, hist, Q, eos_token_ids, prefill=False)
    want = prefill and any(r.seq.params.prompt_logprobs is not None for r in rows[n_dec:])
    prompt_next = np.full((T if want else 0,), -1, np.int32)
    if want:
        off = sum(r.num_new for r in rows[:n_dec])
        for r in rows[n_dec:]:
            s = r.seq
            if s.params.prompt_logprobs is not None:
                nxt = s.prompt_token_ids[s.num_computed + 1 : min(s.num_computed + 1 + r.num_new,
                                                                   len(s.prompt_token_ids))]
                prompt_next[off : off + len(nxt)] = nxt
            off += r.num_new
    return proc.replace(prompt_next=prompt_next)


def describe_shapes(shapes) -> str:
    """One line for the server's startup log: how many shapes warmup compiles, by family."""
    kinds = collections.Counter(("decode" if s.decode else "general") + (" filtering" if s.filtering == "on" else "")
                                for s in shapes)
    return f"{len(shapes)} shapes (" + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + ")"
