"""Stage ``fetch_images@<source>``: images + captions as WebDataset shards in ``paths.shards/<source>/``.

Output layout (img2dataset's ``webdataset`` format, for both kinds)::

    00000.tar            KEY.jpg, KEY.txt (caption), KEY.json (metadata) per fetched image
    00000.parquet        one row per tried sample: key, caption, status, error_message, sizes, ...
    00000_stats.json     count, successes, failed_to_download, failed_to_resize, status_dict
    .fetch-fingerprint   (laion) what the shards were fetched from: filtered.parquet's hash + settings

* ``laion``: ``img2dataset.download`` over ``filtered.parquet`` (``url``, ``caption``), resized to
  ``image_size`` (``resize_mode``, center crop by default), with ``processes``/``threads``/
  ``timeout``/``retries`` and ``distributor`` (multiprocessing, or pyspark/ray for many machines)
  passed through. Every URL goes through the SSRF guard (:mod:`sdforge.ingest.url_guard`: http(s) only,
  public addresses only unless ``allow_networks`` covers them, checked in the workers at connection
  time); images over ``max_image_pixels`` are refused. With ``fetch.serve_demo`` a loopback HTTP
  server serves ``paths.demo_source/http`` meanwhile. img2dataset starts worker processes with
  *spawn*: keep calls under ``if __name__ == "__main__"``.
* ``diffusiondb``: the filtered rows' images are read from the zips in ``paths.metadata/<source>``,
  decoded with OpenCV, resized like img2dataset and written with ``webdataset.TarWriter``.

**Resume (laion).** The fetch is kill-safe: ``.fetch-fingerprint`` is written first; a rerun whose
fingerprint (``filtered.parquet``'s SHA-256 and the settings that change the shards: image_size,
resize_mode, shard_size, encode_quality, allow_networks, max_image_pixels, user_agent_token) is the
same keeps the finished shards, deletes what a kill left (tars/parquets without stats, ``_tmp/``,
temporaries) and lets img2dataset's incremental mode fetch only the rest; a different fingerprint
empties the folder first. Under DVC this needs ``persist: true`` on the stage's output (DVC deletes
outputs before running a stage otherwise).

The shards are then made deterministic (samples sorted by key, fixed tar mtimes, parquet rows
sorted, timings dropped from ``*_stats.json``; idempotent), since DVC hashes the folder. Metrics:
``samples``, ``successes``, ``failed_to_download``, ``failed_to_resize``, ``success_rate``,
``shards``, ``skipped_<status>`` for other statuses, and for laion why samples failed:
``refused_scheme``, ``refused_ssrf``, ``error_http``, ``error_network``, ``error_decode``,
``error_too_many_pixels``, ``error_robots``, ``error_other`` (they sum to the two ``failed_*``).
See ``docs/FETCH.md``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl

from sdforge.config import Params, Source
from sdforge.demo.http_server import serve_directory
from sdforge.ingest import reshard, shards, sources, url_guard
from sdforge.ingest.fetch_state import archive_listing, fingerprint, prepare_out_dir, served_digest
from sdforge.ingest.url_fetch import check_no_credentials, fetch_urls
from sdforge.io import InputError, stage_cli
from sdforge.tracking import log_stage

log = logging.getLogger(__name__)

SUPPORTED_KINDS = frozenset({"laion"}) | sources.LOCAL_KINDS


@contextlib.contextmanager
def maybe_serve(serve: tuple[Path, int] | None) -> Iterator[None]:
    """Serve ``(root, port)`` on loopback for the duration, or do nothing when ``serve`` is None."""
    with contextlib.ExitStack() as stack:
        if serve is not None:
            root, port = serve
            try:
                stack.enter_context(serve_directory(root, port))
            except FileNotFoundError as err:
                raise InputError(f"fetch.serve_demo is true but {err}") from None
            except OSError as err:
                raise InputError(f"cannot serve the demo on 127.0.0.1:{port} ({err}); change demo.http_port") from None
        yield


def run(
    source: Source,
    name: str,
    filtered_dir: str | Path,
    metadata_dir: str | Path,
    out_dir: str | Path,
    serve: tuple[Path, int] | None = None,
) -> dict[str, Any]:
    """Fetch source ``name``'s filtered rows into ``out_dir``; return metrics.

    Resumes in ``out_dir`` when its fingerprint matches (finished shards kept), else empties it
    first. ``serve=(root, port)`` serves ``root`` on loopback while fetching (demo).
    """
    if source.kind not in SUPPORTED_KINDS:
        raise InputError(
            f"sources.{name}.kind: '{source.kind}' has no fetch adapter yet (supported: {sorted(SUPPORTED_KINDS)})"
        )
    filtered, metadata_dir, out_dir = Path(filtered_dir) / sources.FILTERED_FILE, Path(metadata_dir), Path(out_dir)
    if not filtered.is_file():
        raise InputError(f"{filtered} not found (run filter_metadata first)")
    fetch = source.fetch
    rows = pl.scan_parquet(filtered).select(pl.len()).collect().item()
    if source.kind == "laion":
        check_no_credentials(filtered)  # before the output folder is touched
    archives = None if source.kind == "laion" else archive_listing(metadata_dir)
    served = served_digest(serve[0]) if serve and source.kind == "laion" else None  # same URLs, new images
    prepare_out_dir(out_dir, fingerprint(filtered, fetch, archives, served))
    if rows == 0:
        log.warning("%s: %s has no rows; nothing to fetch", name, filtered)
    elif source.kind == "laion":
        with maybe_serve(serve):
            fetch_urls(filtered, out_dir, fetch, rows)
    else:
        reshard.run(filtered, metadata_dir, out_dir, fetch, name, source.fetch.max_caption_chars)
    if source.kind == "laion":
        metrics = shards.summarize_stats(out_dir, url_guard.failure_reason, url_guard.REASONS)
    else:
        metrics = shards.summarize_stats(out_dir)
    if metrics["samples"] and metrics["success_rate"] < fetch.min_success_rate:
        log.warning("!!! %s", low_success_message(name, source.kind, metrics, fetch.min_success_rate, out_dir))
    return metrics


def low_success_message(name: str, kind: str, metrics: dict, min_rate: float, out_dir: Path) -> str:
    """The warning for a fetch under ``fetch.min_success_rate``, with the likely cause for the source's kind."""
    cause = (
        "DNS or network access is the likely cause"
        if kind == "laion"  # the only kind fetched over the network
        else "the archives or files in the metadata folder are the likely cause (no network is involved)"
    )
    return (
        f"{name}: only {100 * metrics['success_rate']:.1f}% of {metrics['samples']} images fetched "
        f"(fetch.min_success_rate {100 * min_rate:.0f}%). {cause}; see the *.parquet error_message column and "
        f"status_dict in {out_dir}"
    )


def run_stage(params: Params, item: str) -> dict[str, Any]:
    """Resolve paths from ``params`` and run the stage for source ``item``."""
    source = params.sources[item]
    serve = (Path(params.paths.demo_source) / "http", params.demo.http_port) if source.fetch.serve_demo else None
    metrics = run(
        source,
        item,
        Path(params.paths.filtered) / item,
        Path(params.paths.metadata) / item,
        Path(params.paths.shards) / item,
        serve=serve,
    )
    note = (
        f"- fetch `{item}`: {metrics['successes']} of {metrics['samples']} images "
        f"({metrics['success_rate']:.1%}) in {metrics['shards']} WebDataset shard(s)"
    )
    headline = ("samples", "successes", "success_rate")
    log_stage(
        params.tracking,
        "data",
        f"fetch_images@{item}",
        metrics,
        source.fetch.model_dump(),
        headline=headline,
        note=note,
    )
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.fetch_images --params params.yaml --item <source>``."""
    stage_cli("fetch_images", run_stage, argv=argv)


if __name__ == "__main__":
    main()
