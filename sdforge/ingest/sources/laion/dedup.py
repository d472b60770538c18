"""Dedup of the LAION rows the quality rules kept: first of each normalised URL, then first of each ``hash``.

The URL key is the URL stripped, its scheme and host lower-cased (path and query as they are), held
as a 128-bit hash (two seeded 64-bit hashes): two different URLs collide with probability
~n²/2¹²⁹ (n = kept rows), nil. Only the few URLs that normalising changes (a scheme or host with an
upper-case or non-ASCII letter) go through the regex; the others are hashed as they are. A null or
empty URL or hash is dropped by its dedup rule.
"""

from __future__ import annotations

import polars as pl

from sdforge.config import FilterRules
from sdforge.ingest.sources.laion.histograms import HISTOGRAMS, histogram_bin

# scheme://host (lower-cased by the URL normalisation); the rest is kept as is
_URL_HEAD = r"^([A-Za-z][A-Za-z0-9+.\-]*://[^/?#]*)"
# a URL whose scheme or host has an upper-case or non-ASCII letter (the only ones normalising changes)
_URL_HEAD_NOT_LOWER = (
    r"^(?:[A-Za-z][A-Za-z0-9+.\-]*://[^/?#]*(?:[A-Z]|[^\x00-\x7F])"
    r"|(?:[A-Z]|[A-Za-z][A-Za-z0-9+.\-]*[A-Z])[A-Za-z0-9+.\-]*://)"
)
_URL_SEEDS = (0x5D_F0_12_6E, 0x2B_C7_9A_13)  # two independent 64-bit hashes of the URL key


def with_normalized_url(lf: pl.LazyFrame, url: str, out: str) -> pl.LazyFrame:
    """``lf`` plus ``out``: column ``url`` stripped, its scheme and host lower-cased (path and query as is).

    As ``^(scheme://host)(.*)$`` with the head lower-cased: one anchored ``extract`` for the head, the
    tail sliced off after it (no match, or a tail with a newline, which ``.`` does not cross: unchanged).
    Built in steps (each intermediate computed once), then the helper columns dropped.
    """
    s, head, tail = pl.col("_url_s"), pl.col("_url_head"), pl.col("_url_tail")
    lf = lf.with_columns(pl.col(url).str.strip_chars().alias("_url_s"))
    lf = lf.with_columns(s.str.extract(_URL_HEAD, 1).alias("_url_head"))
    lf = lf.with_columns(s.str.slice(head.str.len_chars()).alias("_url_tail"))
    matched = head.is_not_null() & ~tail.str.contains("\n", literal=True)
    key = pl.when(matched).then(head.str.to_lowercase() + tail).otherwise(s)
    return lf.with_columns(key.alias(out)).drop("_url_s", "_url_head", "_url_tail")


def _first_of_key(candidates: pl.Expr, key: pl.Expr) -> pl.Expr:
    """``candidates`` rows whose ``key`` no earlier candidate row has (the other rows' keys do not count)."""
    return candidates & pl.when(candidates).then(key).is_first_distinct()


def url_first(keys: pl.DataFrame) -> pl.Series:
    """Rows of ``keys`` (``_url_valid``, 128-bit URL hash ``_url0``/``_url1``) that are the first of their URL.

    Single-column passes on ``_url0`` find the few rows whose ``_url0`` repeats; only those are compared
    on both halves (a struct comparison costs ~250 bytes a row, a u64 one ~50).
    """
    valid, url0 = pl.col("_url_valid"), pl.col("_url0")
    keys = keys.with_row_index("_i").with_columns(_first_of_key(valid, url0).alias("_first0"))
    repeated = keys.filter(valid & ~pl.col("_first0"))["_url0"]
    repeats = keys.filter(valid & url0.is_in(repeated.implode()))
    repeats = repeats.filter(pl.struct("_url0", "_url1").is_first_distinct())
    first = (pl.col("_first0") & ~url0.is_in(repeated.implode())) | pl.col("_i").is_in(repeats["_i"].implode())
    return keys.select(first.alias("_url_ok")).to_series()


def _url_key_columns() -> list[pl.Expr]:
    """``_url0``/``_url1`` (128-bit hash), ``_url_valid``, and ``_url_redo``: the text of a URL that
    normalising changes (scheme or host with an upper-case or non-ASCII letter), null for the others.

    The hashes are of the URL as it is; :func:`_fix_url_keys` re-hashes the few ``_url_redo`` rows
    normalised (the regex ``extract`` is most of the cost of normalising, so it runs on those only).
    """
    url = pl.col("url").str.strip_chars()
    return [
        *(url.hash(seed).alias(f"_url{i}") for i, seed in enumerate(_URL_SEEDS)),
        (url != "").fill_null(False).alias("_url_valid"),
        pl.when(url.str.contains(_URL_HEAD_NOT_LOWER)).then(url).alias("_url_redo"),
    ]


def _fix_url_keys(keys: pl.DataFrame) -> pl.DataFrame:
    """Replace the hashes of the ``_url_redo`` rows by those of their normalised URL; drop ``_url_redo``."""
    redo = keys.lazy().with_row_index("_i").filter(pl.col("_url_redo").is_not_null())
    redo = with_normalized_url(redo, "_url_redo", "_url").select(
        "_i", *(pl.col("_url").hash(seed).alias(f"_url{i}") for i, seed in enumerate(_URL_SEEDS))
    )
    redo = redo.collect()
    fixed = [keys[f"_url{i}"].scatter(redo["_i"], redo[f"_url{i}"]) for i in range(len(_URL_SEEDS))]
    return keys.with_columns(fixed).drop("_url_redo")


def dedup_mask(kept: pl.LazyFrame, rules: FilterRules) -> pl.DataFrame:
    """Over the rows the quality rules kept (columns ``url, hash, aesthetic, similarity``): ``_url_ok``
    (first of its normalised URL), ``_keep`` (and first of its hash) and the histogram bins.

    Fixed-width columns only (a 128-bit hash of the URL key, the hash, the bins) plus the text of the
    few URLs that normalising changes: O(kept rows × ~40 bytes).
    """
    hash_valid = pl.col("hash").is_not_null()
    if kept.collect_schema()["hash"] == pl.String:
        hash_valid = hash_valid & (pl.col("hash") != "").fill_null(False)
    columns = ["hash", hash_valid.alias("_hash_valid"), *(histogram_bin(n).alias(f"_{n}_bin") for n in HISTOGRAMS)]
    keys = kept.select(*columns, *(_url_key_columns() if rules.dedup_url else [])).collect(engine="streaming")
    if rules.dedup_url:
        keys = _fix_url_keys(keys)
        keys = keys.with_columns(url_first(keys).alias("_url_ok"))
    else:
        keys = keys.with_columns(pl.lit(True).alias("_url_ok"))
    keep = pl.col("_url_ok")
    if rules.dedup_hash:
        keep = _first_of_key(keep & pl.col("_hash_valid"), pl.col("hash"))
    return keys.select("_url_ok", keep.alias("_keep"), *(f"_{name}_bin" for name in HISTOGRAMS))
