"""How a phase's mix fractions become sample counts (used by ``mix_phase`` and the preflight's params)."""

from __future__ import annotations

import math


def split_counts(mix: dict[str, float], total: int) -> dict[str, int]:
    """Integer sample counts per source summing exactly to ``total`` (largest remainder, ties by name)."""
    raw = {name: frac * total for name, frac in mix.items()}
    counts = {name: math.floor(v) for name, v in raw.items()}
    short = total - sum(counts.values())
    by_remainder = sorted(raw, key=lambda n: (-(raw[n] - counts[n]), n))
    for name in by_remainder[:short]:
        counts[name] += 1
    return counts


def smallest_total(mix: dict[str, float], multiple: int) -> int:
    """The smallest multiple of ``multiple`` whose :func:`split_counts` gives every source at least one sample."""
    total = multiple
    while min(split_counts(mix, total).values()) < 1:
        total += multiple
    return total
