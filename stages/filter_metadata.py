"""Stage ``filter_metadata@<source>``: quality filter + dedup → ``paths.filtered/<source>/filtered.parquet``.

* ``laion``: every parquet under ``paths.metadata/<source>`` (sorted paths, hidden folders such as
  the hub's ``.cache`` skipped, then row order: the "first" row of a duplicate group is
  deterministic). Configured column names (``source.columns``) become ``url, caption, width, height,
  similarity, punsafe, pwatermark, aesthetic, hash``. Rules run in :data:`LAION_RULES` order; a
  ``None`` threshold turns a rule off; each dropped row is counted once, under the first rule it
  fails. Dedup runs over the rows the quality rules kept: normalised URL (stripped, scheme and host
  lower-cased), then ``hash``; a null or empty key is dropped by its dedup rule.
* other kinds: :func:`stages.sources.filter_source`.

Bad values (LAION kind). A rule fails a value that is null, NaN or ±inf, and a negative one (no
width, height, aesthetic score or CLIP similarity is negative in real metadata; a negative
``pwatermark``/``punsafe`` is not a probability, so it is treated as corrupt, not as "certainly
clean"). A column of the wrong type is cast per file, non-strictly: ``"512"`` is 512, ``"abc"`` is
null (fails its rule). Captions are kept as they are (empty or long). A file that is not parquet,
or lacks a column a rule needs, is an :class:`InputError` naming the file (and the column).

Memory. Three streaming passes over the input, none of which holds it: (1) the rule columns only
→ ``group_by(first failed rule, aesthetic bin, similarity bin).len()`` (the counts, the "before"
histograms); (2) the URL and hash of the rows the rules keep (the rule predicate is pushed into the
parquet reader, which materialises the text columns only for those rows) → a 128-bit hash of each
normalised URL → which rows are the first of their URL and hash; (3) every column of the kept rows,
minus the repeats → ``filtered.parquet``. Only pass 2 keeps anything per row: ~40 bytes per row the
rules keep, never per input row. The parquet reader's row-group prefetch is held to
:data:`ROW_GROUP_PREFETCH` (polars' default, a whole file's row groups up to 64 MiB a file, raised
the peak by ~40 %). Two different URLs collide with probability ~n²/2¹²⁹ (n = kept rows): nil.
Measured at 10M rows against pandas: ``bench/filter_metadata.py`` and ``bench/README.md``.

Metrics: ``files``, ``rows_in``, ``dropped_<rule>`` per rule, ``rows_out``. MLflow also gets the
metrics JSON and a PNG (+ JSON) of the aesthetic and similarity histograms before and after.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from stages import sources
from stages.common import InputError, stage_cli
from stages.config import Columns, FilterRules, Source, Tracking

log = logging.getLogger(__name__)

OUTPUT_FILE = "filtered.parquet"
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
HISTOGRAMS = {"aesthetic": (0.0, 10.0, 100), "similarity": (0.0, 0.5, 100)}
"""Histogram ranges ``(low, high, bins)``; values outside fall in the end bins, null/NaN in none."""
# scheme://host (lower-cased by the URL normalisation); the rest is kept as is
_URL_HEAD = r"^([A-Za-z][A-Za-z0-9+.\-]*://[^/?#]*)"
# a URL whose scheme or host has an upper-case or non-ASCII letter (the only ones normalising changes)
_URL_HEAD_NOT_LOWER = (
    r"^(?:[A-Za-z][A-Za-z0-9+.\-]*://[^/?#]*(?:[A-Z]|[^\x00-\x7F])"
    r"|(?:[A-Z]|[A-Za-z][A-Za-z0-9+.\-]*[A-Z])[A-Za-z0-9+.\-]*://)"
)
_URL_SEEDS = (0x5D_F0_12_6E, 0x2B_C7_9A_13)  # two independent 64-bit hashes of the URL key
ROW_GROUP_PREFETCH = "2"
"""``POLARS_ROW_GROUP_PREFETCH_SIZE`` while this stage's queries run, unless set in the environment."""
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
        """
        lf = pl.scan_parquet(self.path)
        if where is not None:
            lf = lf.filter(where)
        return lf.select([self.cols[name].alias(name) for name in names or self.cols])


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
        cols["url"] = cols["url"].str.strip_chars()
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


def _bin(name: str) -> pl.Expr:
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
    keys = [reason.alias("_reason")] + [_bin(name).alias(f"_{name}_bin") for name in HISTOGRAMS]
    return lf.group_by(keys).len().collect(engine="streaming")


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
    columns = ["hash", hash_valid.alias("_hash_valid"), *(_bin(n).alias(f"_{n}_bin") for n in HISTOGRAMS)]
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


def filter_laion(in_dir: Path, out_file: Path, columns: Columns, rules: FilterRules) -> tuple[dict, Histograms]:
    """Filter every parquet under ``in_dir`` into ``out_file``; return the metrics and the histograms."""
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
        out = kept().with_columns(pl.col("width", "height").cast(pl.Int64, strict=False))
        n_url_ok, n_out = int(mask["_url_ok"].sum()), int(mask["_keep"].sum())
        if n_out < mask.height:
            rows = mask.with_row_index("_i").filter("_keep")["_i"]
            out = out.with_row_index("_i").filter(pl.col("_i").is_in(rows.implode())).drop("_i")
        sink = dict(compression="zstd", compression_level=OUTPUT_ZSTD_LEVEL, maintain_order=True, engine="streaming")
        _run(lambda: out.sink_parquet(out_file, **sink), paths)

    by_reason = dict(binned.group_by("_reason").agg(pl.col("len").sum()).iter_rows())
    if mask.height != by_reason.get(0, 0):
        raise InputError(f"{in_dir}: the metadata files changed while being filtered; run the stage again")
    dropped = {name: by_reason.get(code, 0) for code, (name, _) in enumerate(quality_checks(rules), start=1)}
    dropped |= {"duplicate_url": mask.height - n_url_ok, "duplicate_hash": n_url_ok - n_out}
    metrics = {"files": len(paths), "rows_in": sum(by_reason.values())}
    metrics |= {f"dropped_{rule}": dropped.get(rule, 0) for rule in LAION_RULES}
    metrics["rows_out"] = n_out
    hist = Histograms(before=Histograms.count(binned, "len"), after=Histograms.count(mask.filter("_keep")))
    return metrics, hist


def histogram_figure(hist: Histograms, rules: FilterRules, rows_in: int, rows_out: int):
    """Aesthetic and similarity histograms before (every input row) and after (the kept rows), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def log_to_mlflow(
    tracking: Tracking, name: str, source: Source, metrics: dict[str, int], hist: Histograms | None
) -> None:
    """Log the metrics, the metrics JSON and (LAION kind) the histograms to the ``filter_metadata@<source>`` run."""
    from stages.tracking import stage_run

    params = {"kind": source.kind, "filter": source.filter.model_dump()}
    with stage_run(tracking, parent="data", stage=f"filter_metadata@{name}", params=params) as mlflow:
        mlflow.log_metrics(metrics)
        mlflow.log_dict(metrics, f"filter_metadata/{name}.json")
        if hist is not None:
            fig = histogram_figure(hist, source.filter, metrics["rows_in"], metrics["rows_out"])
            mlflow.log_figure(fig, f"filter_metadata/{name}_histograms.png")
            mlflow.log_dict(
                {"bins": HISTOGRAMS, "before": hist.before, "after": hist.after},
                f"filter_metadata/{name}_histograms.json",
            )


def run(
    source: Source,
    name: str,
    in_dir: str | Path,
    out_dir: str | Path,
    tracking: Tracking | None = None,
) -> dict[str, int]:
    """Filter source ``name`` from ``in_dir`` into ``out_dir/filtered.parquet``; return metrics.

    ``tracking=None`` skips MLflow (unit tests).
    """
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if not in_dir.is_dir():
        raise InputError(f"metadata folder {in_dir} not found (run download_metadata first)")
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    hist = None
    if source.kind == "laion":
        metrics, hist = filter_laion(in_dir, out_dir / OUTPUT_FILE, source.columns, source.filter)
    else:
        metrics = sources.filter_source(source, name, in_dir, out_dir / OUTPUT_FILE)
    log.info("%s: kept %d of %d rows: %s", name, metrics["rows_out"], metrics["rows_in"], metrics)
    if tracking is not None:
        log_to_mlflow(tracking, name, source, metrics, hist)
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.filter_metadata --params params.yaml --item <source>``."""
    stage_cli(
        "filter_metadata",
        lambda params, item: run(
            params.sources[item],
            item,
            Path(params.paths.metadata) / item,
            Path(params.paths.filtered) / item,
            tracking=params.tracking,
        ),
        argv=argv,
    )


if __name__ == "__main__":
    main()
