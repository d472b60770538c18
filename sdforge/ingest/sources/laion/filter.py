"""LAION-kind metadata → ``filtered.parquet``: threshold rules, then dedup, in three streaming polars passes.

Input: every parquet under the metadata folder (sorted paths, hidden folders such as the hub's
``.cache`` skipped, then row order: the "first" row of a duplicate group is deterministic).
Configured column names (``source.columns``) become ``url, caption, width, height, similarity,
punsafe, pwatermark, aesthetic, hash``. Rules run in :data:`LAION_RULES` order; a ``None``
threshold turns a rule off; each dropped row is counted once, under the first rule it fails. Dedup
runs over the rows the quality rules kept (:mod:`sdforge.ingest.sources.laion.dedup`): normalised URL (stripped,
scheme and host lower-cased), then ``hash``; a null or empty key is dropped by its dedup rule.

Bad values. A rule fails a value that is null, NaN or ±inf, and a negative one (no width, height,
aesthetic score or CLIP similarity is negative in real metadata; a negative
``pwatermark``/``punsafe`` is not a probability, so it is treated as corrupt, not as "certainly
clean"). A column of the wrong type is cast per file, non-strictly: ``"512"`` is 512, ``"abc"`` is
null (fails its rule). Captions are kept as they are (empty or long). A URL's userinfo
(``http://user:secret@host/``) is stored as ``***`` and counted in ``urls_credentials_redacted``
(:mod:`sdforge.ingest.url_credentials`). A file that is not parquet, or lacks a column a rule needs, is an
:class:`InputError` naming the file (and the column).

Memory. Three streaming passes over the input, none of which holds it: (1) the rule columns only →
``group_by(first failed rule, aesthetic bin, similarity bin).len()`` (the counts, the "before"
histograms); (2) the URL and hash of the rows the rules keep (the rule predicate is pushed into the
parquet reader, which materialises the text columns only for those rows) → a 128-bit hash of each
normalised URL → which rows are the first of their URL and hash; (3) every column of the kept rows,
minus the repeats → ``filtered.parquet``. Only pass 2 keeps anything per row: ~40 bytes per row the
rules keep, never per input row. The parquet reader's row-group prefetch is held to
:data:`ROW_GROUP_PREFETCH` (polars' default, a whole file's row groups up to 64 MiB a file, raised
the peak by ~40 %). Measured at 10M rows against pandas: ``bench/filter_metadata.py`` and
``bench/README.md``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from sdforge.config import Columns, FilterRules
from sdforge.ingest import url_credentials
from sdforge.ingest.sources.laion.dedup import dedup_mask
from sdforge.ingest.sources.laion.histograms import HISTOGRAMS, Histograms, histogram_bin
from sdforge.ingest.sources.rows import TRUNCATED_COLUMN
from sdforge.io import InputError, naming_write_faults

log = logging.getLogger(__name__)

LAION_RULES = (
    "aesthetic",
    "similarity",
    "width",
    "height",
    "pwatermark",
    "punsafe",
    "duplicate_url",
    "duplicate_hash",
)
FLOAT_COLUMNS = ("width", "height", "similarity", "punsafe", "pwatermark", "aesthetic")
ROW_GROUP_PREFETCH = "2"
"""``POLARS_ROW_GROUP_PREFETCH_SIZE`` while the filter's queries run, unless set in the environment."""
OUTPUT_ZSTD_LEVEL = 1
"""zstd level of ``filtered.parquet``: level 3 (polars' default) cost 0.2 s more at 10M rows for a 4 % smaller file."""
_TEXT_TYPES = (pl.String, pl.Categorical, pl.Enum, pl.Binary, pl.Null)


def quality_checks(rules: FilterRules, cols: dict[str, pl.Expr] | None = None) -> list[tuple[str, pl.Expr]]:
    """``(rule, passes)`` for each enabled threshold rule, in :data:`LAION_RULES` order.

    ``cols`` maps a normalised column name to the expression that reads it (default ``pl.col(name)``).
    ``passes`` is false for null, NaN, ±inf and negative values: ``min ≤ x < inf`` or ``0 ≤ x < max``
    (polars orders NaN above +inf, so both bounds reject it).
    """
    thresholds: list[tuple[str, Any, str]] = [
        ("aesthetic", rules.min_aesthetic, ">="),
        ("similarity", rules.min_similarity, ">="),
        ("width", rules.min_width, ">="),
        ("height", rules.min_height, ">="),
        ("pwatermark", rules.max_pwatermark, "<"),
        ("punsafe", rules.max_punsafe, "<"),
    ]
    checks = []
    for name, value, op in thresholds:
        if value is not None:
            col = cols[name] if cols else pl.col(name)
            low, high = (max(value, 0), math.inf) if op == ">=" else (0, value)
            checks.append((name, col.is_between(low, high, closed="left").fill_null(False)))
    return checks


def parquet_files(in_dir: Path) -> list[Path]:
    """The ``*.parquet`` files under ``in_dir``, sorted, outside hidden folders (``.cache`` etc.)."""
    files = sorted(in_dir.rglob("*.parquet"))
    return [p for p in files if not any(part.startswith(".") for part in p.relative_to(in_dir).parts)]


def read_schemas(files: list[Path]) -> dict[Path, pl.Schema]:
    """Each file's schema (its footer); a file that is not parquet or is truncated is an InputError."""
    schemas = {}
    for path in files:
        try:
            schemas[path] = pl.Schema(pl.read_parquet_schema(path))
        except (pl.exceptions.PolarsError, OSError) as err:
            raise InputError(
                f"{path}: not a readable parquet file ({err}); delete it and re-run download_metadata"
            ) from None
    return schemas


def _hash_dtype(schemas: dict[Path, pl.Schema], column: str) -> pl.DataType:
    """The ``hash`` column's type where the files agree on it, else String (every file cast to it)."""
    dtypes = {schema[column] for schema in schemas.values() if column in schema}
    if len(dtypes) == 1:
        return dtypes.pop()
    if dtypes:
        log.warning("column %r has different types across the files (%s); compared as text", column, dtypes)
    return pl.String


@dataclass(frozen=True)
class LaionFile:
    """One metadata file and the expressions that read its configured columns as the normalised ones."""

    path: Path
    cols: dict[str, pl.Expr]

    def scan(self, names: list[str] | None = None, where: pl.Expr | None = None) -> pl.LazyFrame:
        """The normalised ``names`` (default: all), of the rows where ``where`` (on the raw columns) holds.

        Filtering on the raw columns lets polars push the predicate into the parquet reader, which
        then materialises the other columns (URL, caption) only for the rows that pass.

        ``with_columns`` then ``select``, not ``select`` alone: a column absent from the file is a literal,
        and a ``select`` of literals only is ONE row whatever the file holds; ``with_columns`` keeps the
        file's row count (polars then reads one real column to know it), for any subset of columns.
        """
        names = names or list(self.cols)
        lf = pl.scan_parquet(self.path)
        if where is not None:
            lf = lf.filter(where)
        return lf.with_columns([self.cols[name].alias(name) for name in names]).select(names)


def laion_files(files: list[Path], columns: Columns, rules: FilterRules) -> list[LaionFile]:
    """Each file with its column expressions; a column that a rule needs must exist in every file."""
    schemas = read_schemas(files)
    hash_dtype = _hash_dtype(schemas, columns.hash)
    needed = {"url", "caption"} | {name for name, _ in quality_checks(rules)}
    if rules.dedup_hash:
        needed.add("hash")
    out = []
    for path in files:
        schema, cols = schemas[path], {}
        for norm, configured in columns.model_dump().items():
            if configured in schema:
                _check_dtype(path, configured, norm, schema[configured])
                expr = pl.col(configured)
            elif norm in needed:
                raise InputError(
                    f"{path}: column {configured!r} (columns.{norm}) not found; its columns are {list(schema)}"
                )
            else:
                expr = pl.lit(None)
            if norm in FLOAT_COLUMNS:
                expr = expr.cast(pl.Float64, strict=False)
            elif norm in ("url", "caption"):
                expr = expr.cast(pl.String, strict=False)
            else:
                expr = expr.cast(hash_dtype, strict=False)
            cols[norm] = expr
        cols["url"] = url_credentials.redacted(cols["url"].str.strip_chars())  # no secret stored (nor deduped on)
        out.append(LaionFile(path, cols))
    return out


def _check_dtype(path: Path, column: str, norm: str, dtype: pl.DataType) -> None:
    """A column must be castable to its normalised type (numbers and text are; lists, structs are not)."""
    if norm in FLOAT_COLUMNS:
        ok = dtype.is_numeric() or isinstance(dtype, _TEXT_TYPES) or dtype == pl.Boolean
    else:
        ok = dtype.is_numeric() or isinstance(dtype, _TEXT_TYPES)
    if not ok:
        expected = "numbers (or text holding numbers)" if norm in FLOAT_COLUMNS else "text or numbers"
        raise InputError(f"{path}: column {column!r} (columns.{norm}) has type {dtype}; expected {expected}")


def rule_counts(files: list[LaionFile], rules: FilterRules) -> pl.DataFrame:
    """Pass 1, the rule columns only: rows per (first failed rule, aesthetic bin, similarity bin).

    ``_reason`` is 0 for a row every rule passes, else the 1-based index of its first failed check.
    """
    checks = quality_checks(rules)
    reason: Any = pl.lit(0, dtype=pl.UInt8)
    for code, (_, passes) in reversed(list(enumerate(checks, start=1))):
        reason = pl.when(~passes).then(pl.lit(code, dtype=pl.UInt8)).otherwise(reason)
    names = list(dict.fromkeys([name for name, _ in checks] + list(HISTOGRAMS)))
    lf = pl.concat([f.scan(names) for f in files])
    keys = [reason.alias("_reason")] + [histogram_bin(name).alias(f"_{name}_bin") for name in HISTOGRAMS]
    return lf.group_by(keys).len().collect(engine="streaming")


@contextlib.contextmanager
def _polars_env(**settings: str):
    """Set polars environment knobs for the block (those the user has not set), then restore them."""
    added = [name for name in settings if name not in os.environ]
    os.environ.update({name: settings[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _run(query: Callable[[], Any], files: list[Path]) -> Any:
    """Run ``query()``; a polars error from unreadable data becomes an InputError naming the file."""
    try:
        return query()
    except pl.exceptions.PolarsError as err:
        for path in files:
            try:
                for _ in pl.scan_parquet(path).collect_batches():
                    pass
            except pl.exceptions.PolarsError as file_err:
                raise InputError(
                    f"{path}: corrupt parquet data ({file_err}); delete it and re-run download_metadata"
                ) from err
        raise


def bounded_caption(max_chars: int | None) -> list[pl.Expr]:
    """The caption cut to ``max_chars`` characters and its ``caption_truncated`` flag (:mod:`sdforge.bounds.captions`;
    None: flagged False, not cut)."""
    if max_chars is None:
        return [pl.lit(False).alias(TRUNCATED_COLUMN)]
    return [
        (pl.col("caption").str.len_chars() > max_chars).fill_null(False).alias(TRUNCATED_COLUMN),
        pl.col("caption").str.slice(0, max_chars),
    ]


def filter_laion(
    in_dir: Path, out_file: Path, columns: Columns, rules: FilterRules, caption_max_chars: int | None = None
) -> tuple[dict, Histograms]:
    """Filter every parquet under ``in_dir`` into ``out_file``, each caption cut to ``caption_max_chars``
    (flagged in ``caption_truncated``); return the metrics and the histograms."""
    paths = parquet_files(in_dir)
    if not paths:
        raise InputError(f"no parquet files under {in_dir} (run download_metadata first)")
    files = laion_files(paths, columns, rules)

    def kept(names: list[str] | None = None) -> pl.LazyFrame:
        scans = []
        for f in files:
            checks = [passes for _, passes in quality_checks(rules, f.cols)]
            scans.append(f.scan(names, where=pl.all_horizontal(checks) if checks else None))
        return pl.concat(scans)

    with _polars_env(POLARS_ROW_GROUP_PREFETCH_SIZE=ROW_GROUP_PREFETCH):
        binned = _run(lambda: rule_counts(files, rules), paths)
        mask = _run(lambda: dedup_mask(kept(["url", "hash", *HISTOGRAMS]), rules), paths)
        out = kept().with_columns(
            pl.col("width", "height").cast(pl.Int64, strict=False), *bounded_caption(caption_max_chars)
        )
        n_url_ok, n_out = int(mask["_url_ok"].sum()), int(mask["_keep"].sum())
        if n_out < mask.height:
            rows = mask.with_row_index("_i").filter("_keep")["_i"]
            out = out.with_row_index("_i").filter(pl.col("_i").is_in(rows.implode())).drop("_i")
        sink = dict(compression="zstd", compression_level=OUTPUT_ZSTD_LEVEL, maintain_order=True, engine="streaming")
        with naming_write_faults(out_file, "the filtered metadata", setting="paths.filtered"):
            _run(lambda: out.sink_parquet(out_file, **sink), paths)

    by_reason = dict(binned.group_by("_reason").agg(pl.col("len").sum()).iter_rows())
    if mask.height != by_reason.get(0, 0):
        raise InputError(f"{in_dir}: the metadata files changed while being filtered; run the stage again")
    dropped = {name: by_reason.get(code, 0) for code, (name, _) in enumerate(quality_checks(rules), start=1)}
    dropped |= {"duplicate_url": mask.height - n_url_ok, "duplicate_hash": n_url_ok - n_out}
    metrics = {"files": len(paths), "rows_in": sum(by_reason.values())}
    metrics |= {f"dropped_{rule}": dropped.get(rule, 0) for rule in LAION_RULES}
    metrics["rows_out"] = n_out
    metrics["captions_truncated"] = int(
        pl.scan_parquet(out_file).select(pl.col(TRUNCATED_COLUMN).sum()).collect().item() or 0
    )
    metrics["urls_credentials_redacted"] = int(
        pl.scan_parquet(out_file).select(url_credentials.is_redacted(pl.col("url")).sum()).collect().item() or 0
    )
    hist = Histograms(before=Histograms.count(binned, "len"), after=Histograms.count(mask.filter("_keep")))
    return metrics, hist
