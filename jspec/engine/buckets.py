"""Static shape buckets: the known, bounded set of shapes the jitted step compiles for."""

from __future__ import annotations

import dataclasses


def pow2_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2lo, 4lo, ... capped by hi, with hi itself included."""
    out, b = [], max(1, lo)
    while b < hi:
        out.append(b)
        b *= 2
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

    @classmethod
    def create(cls, max_num_seqs, max_prefill_chunk, max_pages_per_seq, min_prefill=16, min_pages=4):
        return cls(
            batch=pow2_buckets(1, max_num_seqs),
            prefill_q=pow2_buckets(min(min_prefill, max_prefill_chunk), max_prefill_chunk),
            pages=pow2_buckets(min(min_pages, max_pages_per_seq), max_pages_per_seq),
        )
