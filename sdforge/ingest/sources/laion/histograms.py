"""Aesthetic and similarity histograms of the LAION filter: the bins its passes group by, the counts, the figure.

Ranges in :data:`HISTOGRAMS`. ``before`` counts every input row, ``after`` the rows kept (rules and dedup).
"""

from __future__ import annotations

from dataclasses import dataclass

import polars as pl

from sdforge.config import FilterRules

HISTOGRAMS = {"aesthetic": (0.0, 10.0, 100), "similarity": (0.0, 0.5, 100)}
"""Histogram ranges ``(low, high, bins)``; values outside fall in the end bins, null/NaN in none."""


def histogram_bin(name: str) -> pl.Expr:
    """Histogram bin of ``name`` (:data:`HISTOGRAMS`); null for null/NaN, the end bins for values outside."""
    low, high, bins = HISTOGRAMS[name]
    return ((pl.col(name) - low) * (bins / (high - low))).clip(0, bins - 1).cast(pl.Int16, strict=False)


@dataclass
class Histograms:
    """Counts per bin of :data:`HISTOGRAMS`, of every input row (``before``) and of the kept rows (``after``)."""

    before: dict[str, list[int]]
    after: dict[str, list[int]]

    @staticmethod
    def count(binned: pl.DataFrame, weight: str | None = None) -> dict[str, list[int]]:
        """Bin counts per histogram from ``binned``'s ``_<name>_bin`` columns (rows weighted by ``weight``)."""
        out = {}
        for name, (_, _, bins) in HISTOGRAMS.items():
            counts = [0] * bins
            agg = pl.col(weight).sum() if weight else pl.len()
            grouped = binned.group_by(f"_{name}_bin").agg(agg.alias("n")).drop_nulls(f"_{name}_bin")
            for index, n in grouped.iter_rows():
                counts[index] = int(n)
            out[name] = counts
        return out


def histogram_figure(hist: Histograms, rules: FilterRules, rows_in: int, rows_out: int):
    """Aesthetic and similarity histograms before (every input row) and after (the kept rows), log scale."""
    # lazy: matplotlib (~0.5 s) only to draw the figure
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    thresholds = {"aesthetic": rules.min_aesthetic, "similarity": rules.min_similarity}
    fig, axes = plt.subplots(1, len(HISTOGRAMS), figsize=(9, 3.2))
    for ax, (name, (low, high, bins)) in zip(axes, HISTOGRAMS.items(), strict=True):
        edges = [low + (high - low) * i / bins for i in range(bins + 1)]
        ax.stairs(hist.before[name], edges, label=f"before ({rows_in:,} rows)")
        ax.stairs(hist.after[name], edges, label=f"after ({rows_out:,} rows)", fill=True, alpha=0.6)
        if thresholds[name] is not None:
            ax.axvline(thresholds[name], color="k", linestyle="--", linewidth=1, label=f"min {thresholds[name]}")
        ax.set_yscale("log")
        ax.set_xlabel(name)
        ax.set_ylabel("rows")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
