"""Static shape buckets: the known, bounded set of shapes the jitted step compiles for."""

from __future__ import annotations

import dataclasses


def pow2_buckets(lo: int, hi: int, factor: int = 2) -> tuple[int, ...]:
    """lo, lo * factor, lo * factor^2, ... capped by hi, with hi itself included."""
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= factor
    out.append(hi)
    return tuple(out)


def pick(buckets: tuple[int, ...], n: int) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class Buckets:
    batch: tuple[int, ...]  # sequences per step
    prefill_q: tuple[int, ...]  # query tokens per sequence in a prefill step
    pages: tuple[int, ...]  # page-table width
    # Mixed steps (jspec/engine/mixed.py); both empty when the engine does not mix.
    prefill_rows: tuple[int, ...] = ()  # prefill rows of any step: the batch buckets up to max_num_partial_prefills
    mixed_q: tuple[int, ...] = ()  # the prefill segment's chunk width in a mixed step (x4 steps)

    @property
    def prefill_batch(self) -> tuple[int, ...]:
        """Row counts a prefill step can have: prefill_rows when mixing, else every batch bucket."""
        return self.prefill_rows or self.batch

    @classmethod
    def create(cls, max_num_seqs, max_prefill_chunk, max_pages_per_seq, min_prefill=16, min_pages=4,
               *, page_widths: tuple[int, ...] | None = None, max_prefill_rows: int = 0):
        """``page_widths``: the plan's page-table widths (jspec.ops.page_table_widths; None:
        powers of two). ``max_prefill_rows`` > 0: the engine mixes decode rows and prefill
        chunks (jspec/engine/mixed.py) with at most that many prefill rows per step."""
        batch = pow2_buckets(1, max_num_seqs)
        lo = min(min_prefill, max_prefill_chunk)
        rows = ()
        if max_prefill_rows > 0:
            top = pick(batch, min(max_prefill_rows, max_num_seqs))
            rows = tuple(b for b in batch if b <= top)
        return cls(
            batch=batch,
            prefill_q=pow2_buckets(lo, max_prefill_chunk),
            pages=page_widths or pow2_buckets(min(min_pages, max_pages_per_seq), max_pages_per_seq),
            prefill_rows=rows,
            mixed_q=pow2_buckets(lo, max_prefill_chunk, 4) if rows else (),
        )
