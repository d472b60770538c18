"""Stage ``filter_metadata@<source>``: quality filter + dedup → ``paths.filtered/<source>/filtered.parquet``.

* ``laion``: :func:`sdforge.ingest.sources.laion.filter.filter_laion` (threshold rules, then URL and hash dedup, in
  three streaming polars passes that never hold the input).
* other kinds: :func:`sdforge.ingest.sources.filter_source`.

Metrics: ``files``, ``rows_in``, ``dropped_<rule>`` per rule, ``rows_out``, ``captions_truncated``, and (LAION
kind) ``urls_credentials_redacted`` (URLs stored with ``***`` for their userinfo). MLflow also gets the
metrics JSON and (LAION kind) a PNG (+ JSON) of the aesthetic and similarity histograms before and
after (:mod:`sdforge.ingest.sources.laion.histograms`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from sdforge.config import Params, Source, Tracking
from sdforge.ingest import sources
from sdforge.ingest.sources.laion.filter import filter_laion
from sdforge.ingest.sources.laion.histograms import HISTOGRAMS, Histograms, histogram_figure
from sdforge.io import InputError, fresh_folder, stage_cli
from sdforge.tracking import stage_run, summarise

log = logging.getLogger(__name__)


def log_to_mlflow(
    tracking: Tracking, name: str, source: Source, metrics: dict[str, int], hist: Histograms | None
) -> None:
    """Log the metrics, the metrics JSON and (LAION kind) the histograms to the ``filter_metadata@<source>`` run."""
    params = {"kind": source.kind, "filter": source.filter.model_dump()}
    with stage_run(tracking, parent="data", stage=f"filter_metadata@{name}", params=params, deferrable=True) as mlflow:
        mlflow.log_metrics(metrics)
        mlflow.log_dict(metrics, f"filter_metadata/{name}.json")
        rows_in, rows_out = metrics["rows_in"], metrics["rows_out"]
        kept = f"{rows_out / rows_in:.1%}" if rows_in else "-"
        note = (
            f"- filter `{name}`: {rows_in} → {rows_out} rows kept ({kept}); the drops per rule are this run's metrics"
        )
        summarise(mlflow, metrics={"rows_in": rows_in, "rows_out": rows_out}, note=note)
        if hist is not None:
            fig = histogram_figure(hist, source.filter, metrics["rows_in"], metrics["rows_out"])
            mlflow.log_figure(fig, f"filter_metadata/{name}_histograms.png")
            mlflow.log_dict(
                {"bins": HISTOGRAMS, "before": hist.before, "after": hist.after},
                f"filter_metadata/{name}_histograms.json",
            )


def filter_with_histograms(
    source: Source, name: str, in_dir: str | Path, out_dir: str | Path
) -> tuple[dict[str, int], Histograms | None]:
    """Filter source ``name`` from ``in_dir`` into ``out_dir/filtered.parquet``; return metrics and (LAION)
    the before/after histograms."""
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if not in_dir.is_dir():
        raise InputError(f"metadata folder {in_dir} not found (run download_metadata first)")
    fresh_folder(out_dir, "the filtered metadata", setting="paths.filtered")
    hist = None
    if source.kind == "laion":
        metrics, hist = filter_laion(
            in_dir, out_dir / sources.FILTERED_FILE, source.columns, source.filter, source.fetch.max_caption_chars
        )
    else:
        metrics = sources.filter_source(source, name, in_dir, out_dir / sources.FILTERED_FILE)
    log.info("%s: kept %d of %d rows: %s", name, metrics["rows_out"], metrics["rows_in"], metrics)
    return metrics, hist


def run(source: Source, name: str, in_dir: str | Path, out_dir: str | Path) -> dict[str, int]:
    """Filter source ``name`` from ``in_dir`` into ``out_dir/filtered.parquet``; return metrics."""
    return filter_with_histograms(source, name, in_dir, out_dir)[0]


def run_stage(params: Params, item: str) -> dict[str, int]:
    """Resolve source ``item``'s paths from ``params``, run, log metrics and histograms to MLflow."""
    source = params.sources[item]
    metrics, hist = filter_with_histograms(
        source, item, Path(params.paths.metadata) / item, Path(params.paths.filtered) / item
    )
    log_to_mlflow(params.tracking, item, source, metrics, hist)
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.filter_metadata --params params.yaml --item <source>``."""
    stage_cli("filter_metadata", run_stage, argv=argv)


if __name__ == "__main__":
    main()
