"""Stage ``filter_metadata@<source>``: quality filter + dedup → ``paths.filtered/<source>/filtered.parquet``.

* ``laion``: a lazy polars scan of every parquet under ``paths.metadata/<source>`` (sorted paths,
  then row order: the "first" row of a duplicate group is deterministic). Configured column names
  (``source.columns``) become ``url, caption, width, height, similarity, punsafe, pwatermark,
  aesthetic, hash``. Rules run in :data:`LAION_RULES` order; a ``None`` threshold turns a rule
  off; a null/NaN value fails the rule that tests it; each dropped row is counted once, under the
  first rule it fails. Dedup runs over the rows the quality rules kept: normalised URL (stripped,
  scheme and host lower-cased), then ``hash``.
* ``diffusiondb``: the JSON mapping inside every zip → one row per image (``archive, member,
  caption, seed, cfg, steps, sampler``); rows whose member is not in its zip are dropped, then
  repeated member names (first kept).

Metrics: ``rows_in``, ``dropped_<rule>`` per rule, ``rows_out`` (and ``files``); also logged to MLflow.
"""

from __future__ import annotations

import logging
import shutil
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
_REASON = "_drop_reason"
# scheme://host (lower-cased by the URL normalisation) and the rest (kept as is)
_URL_PARTS = r"^([A-Za-z][A-Za-z0-9+.\-]*://[^/?#]*)(.*)$"


def _valid(name: str) -> pl.Expr:
    """Not null and not NaN (polars orders NaN above every number, so ``NaN >= x`` is true)."""
    col = pl.col(name)
    return col.is_not_null() & col.is_not_nan().fill_null(False)


def quality_checks(rules: FilterRules) -> list[tuple[str, pl.Expr]]:
    """``(rule, passes)`` for each enabled threshold rule, in :data:`LAION_RULES` order."""
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
            test = pl.col(name) >= value if op == ">=" else pl.col(name) < value
            checks.append((name, _valid(name) & test))
    return checks


def normalized_url(expr: pl.Expr) -> pl.Expr:
    """Strip whitespace and lower-case the scheme and host (path and query keep their case)."""
    stripped = expr.str.strip_chars()
    head = stripped.str.extract(_URL_PARTS, 1).str.to_lowercase()
    tail = stripped.str.extract(_URL_PARTS, 2)
    return pl.when(head.is_not_null()).then(head + tail).otherwise(stripped)


def normalize_columns(lf: pl.LazyFrame, columns: Columns, rules: FilterRules, origin: str) -> pl.LazyFrame:
    """Rename the configured columns to the normalised names; a column a rule needs must exist."""
    schema = lf.collect_schema()
    needed = {"url", "caption"} | {name for name, _ in quality_checks(rules)}
    if rules.dedup_hash:
        needed.add("hash")
    exprs = []
    for norm, configured in columns.model_dump().items():
        if configured in schema:
            expr = pl.col(configured)
        elif norm in needed:
            raise InputError(f"{origin}: column {configured!r} (columns.{norm}) not found; columns are {list(schema)}")
        else:
            expr = pl.lit(None)
        if norm in FLOAT_COLUMNS:
            expr = expr.cast(pl.Float64, strict=False)
        elif norm in ("url", "caption"):
            expr = expr.cast(pl.String)
        exprs.append(expr.alias(norm))
    return lf.select(exprs).with_columns(pl.col("url").str.strip_chars())


def _mark_duplicates(lf: pl.LazyFrame, rule: str, key: pl.Expr) -> pl.LazyFrame:
    """Among rows not yet dropped, drop (as ``rule``) every repeat of ``key`` and every null/empty key."""
    kept = pl.col(_REASON).is_null()
    valid = key.is_not_null() & (key.cast(pl.String) != "").fill_null(False)
    first = pl.struct(kept.alias("_k"), key.alias("_v")).is_first_distinct()
    dropped = kept & (~valid | ~first)
    return lf.with_columns(pl.when(dropped).then(pl.lit(rule)).otherwise(pl.col(_REASON)).alias(_REASON))


def laion_plan(files: list[Path], columns: Columns, rules: FilterRules) -> pl.LazyFrame:
    """The lazy query: normalised columns plus ``_drop_reason`` (null for kept rows)."""
    lf = normalize_columns(pl.scan_parquet(files), columns, rules, origin=str(files[0].parent))
    reason: Any = pl.lit(None, dtype=pl.String)
    for name, passes in reversed(quality_checks(rules)):
        reason = pl.when(~passes).then(pl.lit(name)).otherwise(reason)
    lf = lf.with_columns(reason.alias(_REASON))
    if rules.dedup_url:
        lf = _mark_duplicates(lf, "duplicate_url", normalized_url(pl.col("url")))
    if rules.dedup_hash:
        lf = _mark_duplicates(lf, "duplicate_hash", pl.col("hash"))
    return lf


def filter_laion(in_dir: Path, out_file: Path, columns: Columns, rules: FilterRules) -> dict[str, int]:
    """Filter every parquet under ``in_dir`` into ``out_file``; return the per-rule counts."""
    files = sorted(in_dir.rglob("*.parquet"))
    if not files:
        raise InputError(f"no parquet files under {in_dir} (run download_metadata first)")
    plan = laion_plan(files, columns, rules)
    counts = dict(plan.group_by(_REASON).len().collect().iter_rows())
    kept = plan.filter(pl.col(_REASON).is_null()).drop(_REASON)
    kept = kept.with_columns(pl.col("width", "height").cast(pl.Int64, strict=False))
    kept.sink_parquet(out_file, maintain_order=True)
    metrics = {"files": len(files), "rows_in": sum(counts.values())}
    metrics |= {f"dropped_{rule}": counts.get(rule, 0) for rule in LAION_RULES}
    metrics["rows_out"] = counts.get(None, 0)
    return metrics


def log_to_mlflow(tracking: Tracking, name: str, source: Source, metrics: dict[str, int]) -> None:
    """Log the metrics and the metrics JSON (artifact) to the ``filter_metadata@<source>`` run."""
    from stages.tracking import stage_run

    params = {"kind": source.kind, "filter": source.filter.model_dump()}
    with stage_run(tracking, parent="data", stage=f"filter_metadata@{name}", params=params) as mlflow:
        mlflow.log_metrics(metrics)
        mlflow.log_dict(metrics, f"filter_metadata/{name}.json")


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
    if source.kind == "laion":
        metrics = filter_laion(in_dir, out_dir / OUTPUT_FILE, source.columns, source.filter)
    else:
        metrics = sources.filter_source(source, name, in_dir, out_dir / OUTPUT_FILE)
    log.info("%s: kept %d of %d rows: %s", name, metrics["rows_out"], metrics["rows_in"], metrics)
    if tracking is not None:
        log_to_mlflow(tracking, name, source, metrics)
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
