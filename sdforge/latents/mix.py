"""How a phase's mix fractions become sample counts (``mix_phase``, the preflight's params) and which samples are
held out of every phase and where they are listed (``mix_phase``, the train stage's validation loss)."""

from __future__ import annotations

import hashlib
import math

import polars as pl

from sdforge.io import InputError

BUCKET_COLUMNS = ("bucket_width", "bucket_height")


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


def held_out_keys(source: str, keys: list[str], count: int) -> set[str]:
    """The ``count`` keys of ``source`` held out of training: those with the smallest SHA-256 of
    ``<source>/<key>``, so the same samples are held out in every phase and at every resolution (each
    resolution's manifest lists the same keys), whatever the phase's seed or mix."""
    unique = sorted(set(keys), key=lambda key: hashlib.sha256(f"{source}/{key}".encode()).digest())
    return set(unique[:count])


def index_columns(manifest: pl.DataFrame, source: str) -> pl.DataFrame:
    """``manifest``'s rows as index rows: ``source, shard, bucket_width, bucket_height, row, key``."""
    return manifest.select(
        pl.lit(source).alias("source"),
        pl.col("shard").cast(pl.Int64),
        *(pl.col(c).cast(pl.Int32) for c in BUCKET_COLUMNS),
        pl.col("row").cast(pl.Int64),
        "key",
    )


def split_held_out(manifests: dict[str, pl.DataFrame], count: int) -> tuple[dict[str, pl.DataFrame], pl.DataFrame]:
    """Each source's manifest without its :func:`held_out_keys`, and those held-out rows as one index sorted by
    (source, bucket, key). A source left with no sample to train on is an InputError naming ``train.held_out``."""
    kept, held = {}, []
    for source, manifest in sorted(manifests.items()):
        keys = held_out_keys(source, manifest["key"].to_list(), count)
        if count and len(keys) >= manifest["key"].n_unique():
            raise InputError(
                f"train.held_out = {count}: source '{source}' has only {manifest['key'].n_unique()} samples, so "
                "holding that many out leaves none to train on; lower train.held_out or add data to the source"
            )
        is_held = pl.col("key").is_in(sorted(keys))
        kept[source] = manifest.filter(~is_held)
        held.append(index_columns(manifest.filter(is_held), source))
    return kept, pl.concat(held).sort("source", *BUCKET_COLUMNS, "key")
