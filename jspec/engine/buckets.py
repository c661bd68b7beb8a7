"""Static shape buckets: the known, bounded sizes the jitted step compiles for (flat_input.FlatShapes)."""

from __future__ import annotations


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
