"""Stage ``fetch_images@<source>``: images + captions as WebDataset shards in ``paths.shards/<source>/``.

Output layout (img2dataset's ``webdataset`` format, for both kinds)::

    00000.tar            KEY.jpg, KEY.txt (caption), KEY.json (metadata) per fetched image
    00000.parquet        one row per tried sample: key, caption, status, error_message, sizes, ...
    00000_stats.json     count, successes, failed_to_download, failed_to_resize, status_dict

* ``laion``: ``img2dataset.download`` over ``filtered.parquet`` (``url``, ``caption``). With
  ``fetch.serve_demo`` a loopback HTTP server serves ``paths.demo_source/http`` meanwhile.
  img2dataset starts worker processes with *spawn*: keep calls under ``if __name__ == "__main__"``.
* ``diffusiondb``: the filtered rows' images are read from the zips in ``paths.metadata/<source>``,
  decoded with OpenCV, resized like img2dataset and written with ``webdataset.TarWriter``.

The shards are then made deterministic (samples sorted by key, fixed tar mtimes, parquet rows
sorted, timings dropped from ``*_stats.json``), since DVC hashes the folder. Metrics: ``samples``,
``successes``, ``failed_to_download``, ``failed_to_resize``, ``success_rate``, ``shards``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl

from stages import reshard, shards, sources
from stages.common import InputError, stage_cli
from stages.config import FetchSettings, Params, Source
from stages.demo_http import serve_directory
from stages.filter_metadata import OUTPUT_FILE

# albumentations (imported by img2dataset) otherwise asks the package index for updates
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

log = logging.getLogger(__name__)

SUPPORTED_KINDS = frozenset({"laion"}) | sources.LOCAL_KINDS


def fetch_urls(filtered: Path, out_dir: Path, fetch: FetchSettings) -> None:
    """Download the ``url``/``caption`` rows of ``filtered`` into webdataset shards with img2dataset."""
    from img2dataset import download

    download(
        url_list=str(filtered),
        input_format="parquet",
        url_col="url",
        caption_col="caption",
        output_format="webdataset",
        output_folder=str(out_dir),
        image_size=fetch.image_size,
        resize_mode=fetch.resize_mode,
        processes_count=fetch.processes,
        thread_count=fetch.threads,
        timeout=fetch.timeout,
        retries=fetch.retries,
        number_sample_per_shard=fetch.shard_size,
        distributor=fetch.distributor,
        encode_quality=fetch.encode_quality,
        enable_wandb=False,
    )
    shards.canonicalize_folder(out_dir)


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
    """Fetch source ``name``'s filtered rows into ``out_dir`` (emptied first); return metrics.

    ``serve=(root, port)`` serves ``root`` on loopback while fetching (demo).
    """
    if source.kind not in SUPPORTED_KINDS:
        raise InputError(
            f"sources.{name}.kind: '{source.kind}' has no fetch adapter yet (supported: {sorted(SUPPORTED_KINDS)})"
        )
    filtered, metadata_dir, out_dir = Path(filtered_dir) / OUTPUT_FILE, Path(metadata_dir), Path(out_dir)
    if not filtered.is_file():
        raise InputError(f"{filtered} not found (run filter_metadata first)")
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    fetch = source.fetch
    if pl.scan_parquet(filtered).select(pl.len()).collect().item() == 0:
        log.warning("%s: %s has no rows; nothing to fetch", name, filtered)
    elif source.kind == "laion":
        with maybe_serve(serve):
            fetch_urls(filtered, out_dir, fetch)
    else:
        reshard.run(filtered, metadata_dir, out_dir, fetch, name)
    metrics = shards.summarize_stats(out_dir)
    if metrics["samples"] and metrics["success_rate"] < fetch.min_success_rate:
        log.warning(
            "!!! %s: only %.1f%% of %d images fetched (fetch.min_success_rate %.0f%%). "
            "DNS or network access is the likely cause; see the *.parquet error_message column in %s",
            name,
            100 * metrics["success_rate"],
            metrics["samples"],
            100 * fetch.min_success_rate,
            out_dir,
        )
    return metrics


def stage(params: Params, item: str) -> dict[str, Any]:
    """Resolve paths from ``params`` and run the stage for source ``item``."""
    from stages.tracking import log_stage

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
    log_stage(params.tracking, "data", f"fetch_images@{item}", metrics, source.fetch.model_dump())
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.fetch_images --params params.yaml --item <source>``."""
    stage_cli("fetch_images", stage, argv=argv)


if __name__ == "__main__":
    main()
