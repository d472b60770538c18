"""Stage ``fetch_images@<source>``: images + captions as WebDataset shards in ``paths.shards/<source>/``.

Output layout (img2dataset's ``webdataset`` format, for both kinds)::

    00000.tar            KEY.jpg, KEY.txt (caption), KEY.json (metadata) per fetched image
    00000.parquet        one row per tried sample: key, caption, status, error_message, sizes, ...
    00000_stats.json     count, successes, failed_to_download, failed_to_resize, status_dict
    .fetch-fingerprint   (laion) what the shards were fetched from: filtered.parquet's hash + settings

* ``laion``: ``img2dataset.download`` over ``filtered.parquet`` (``url``, ``caption``), resized to
  ``image_size`` (``resize_mode``, center crop by default), with ``processes``/``threads``/
  ``timeout``/``retries`` and ``distributor`` (multiprocessing, or pyspark/ray for many machines)
  passed through. Every URL goes through the SSRF guard (:mod:`stages.url_guard`: http(s) only,
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
See ``stages/FETCH.md``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq

from stages import reshard, shards, sources
from stages.common import InputError, atomic_write_bytes, stage_cli
from stages.config import FetchSettings, Params, Source
from stages.demo_http import serve_directory
from stages.filter_metadata import OUTPUT_FILE

# albumentations (imported by img2dataset) otherwise asks the package index for updates
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

log = logging.getLogger(__name__)

SUPPORTED_KINDS = frozenset({"laion"}) | sources.LOCAL_KINDS

FINGERPRINT_FILE = ".fetch-fingerprint"
"""Inside the output folder, so it travels with the shards (DVC cache, checkout). Not ``*.json``:
img2dataset's incremental mode reads every ``*.json`` of the folder as a shard's stats."""
FINGERPRINT_VERSION = 1
OUTPUT_SETTINGS = (
    "image_size",
    "resize_mode",
    "shard_size",
    "encode_quality",
    "allow_networks",
    "max_image_pixels",
    "user_agent_token",
)
"""The fetch settings that change what a finished shard holds (processes, threads, distributor,
timeout, retries and the success-rate warning do not; changing them resumes)."""


class FetchIncomplete(RuntimeError):
    """img2dataset returned with shards unfinished; a rerun fetches only those."""


def archive_listing(metadata_dir: Path) -> str:
    """SHA-256 of the sorted (relative path, size) of every file under ``metadata_dir``.

    The local kinds read their images from these files; downloads are immutable per name, so a
    name or size change is what marks different inputs (mtimes change on every DVC checkout).
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in metadata_dir.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(metadata_dir).as_posix()}\0{path.stat().st_size}\n".encode())
    return digest.hexdigest()


def fingerprint(filtered: Path, fetch: FetchSettings, archives: str | None = None) -> str:
    """The fingerprint text of fetching ``filtered`` with ``fetch``: its SHA-256 and :data:`OUTPUT_SETTINGS`
    (plus, for the local kinds, the :func:`archive_listing` of the files the images come from)."""
    digest = hashlib.sha256()
    with open(filtered, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    settings = {key: getattr(fetch, key) for key in OUTPUT_SETTINGS}
    settings["allow_networks"] = sorted(settings["allow_networks"])
    doc = {"version": FINGERPRINT_VERSION, "filtered_sha256": digest.hexdigest(), "settings": settings}
    if archives is not None:
        doc["archives_sha256"] = archives
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def prepare_out_dir(out_dir: Path, fingerprint_text: str) -> bool:
    """Keep ``out_dir``'s finished shards when its fingerprint matches (return True), else empty it.

    Either way ``out_dir`` then holds the fingerprint and only finished shards.
    """
    path = out_dir / FINGERPRINT_FILE
    if path.is_file() and path.read_text() == fingerprint_text:
        removed = shards.discard_unfinished(out_dir, keep={FINGERPRINT_FILE})
        log.info(
            "resuming the fetch in %s: %d finished shards kept, removed %s",
            out_dir,
            len(shards.finished_shards(out_dir)),
            removed or "nothing",
        )
        return True
    if out_dir.exists():
        log.info("%s was fetched from other inputs or settings (or not by this stage): emptying it", out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    atomic_write_bytes(path, fingerprint_text.encode())
    return False


@contextlib.contextmanager
def _interrupts_stay_interrupts() -> Iterator[None]:
    """Undo img2dataset's SIGINT handler, which exits with status 0 (a DVC stage would look successful)."""
    saved = signal.getsignal(signal.SIGINT)
    try:
        yield
    except SystemExit as exc:
        if exc.code in (0, None):
            raise KeyboardInterrupt("img2dataset was interrupted (SIGINT)") from None
        raise
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, saved)


def fetch_urls(filtered: Path, out_dir: Path, fetch: FetchSettings, rows: int) -> None:
    """Fetch the ``url``/``caption`` rows of ``filtered`` into webdataset shards in ``out_dir``.

    Only the shards ``out_dir`` does not hold finished yet are fetched (img2dataset's incremental
    mode), through :class:`stages.url_guard.GuardedDownloader`, which canonicalises each shard in
    its worker as soon as it is finished; a last pass canonicalises any shard left raw (a kill
    between img2dataset's stats and that step, or a failure there).
    Raises :class:`FetchIncomplete` when img2dataset gave up on a shard.
    """
    from img2dataset import download

    from stages import url_guard

    expected = set(range(math.ceil(rows / fetch.shard_size)))
    start = time.perf_counter()
    if expected - set(shards.finished_shards(out_dir)):
        canonicalize = functools.partial(shards.canonicalize_shard, str(out_dir.resolve()), final=False)
        guard = url_guard.guarded_img2dataset(fetch.allow_networks, fetch.max_image_pixels, after_shard=canonicalize)
        with guard, _interrupts_stay_interrupts():
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
                max_image_area=fetch.max_image_pixels,
                user_agent_token=fetch.user_agent_token,
                incremental_mode="incremental",
                enable_wandb=False,
            )
    missing = sorted(expected - set(shards.finished_shards(out_dir)))
    if missing:
        raise FetchIncomplete(
            f"img2dataset did not finish shards {missing} of {out_dir} (see its log above); "
            "rerun the stage: finished shards are kept and only these are fetched"
        )
    fetched = time.perf_counter()
    check_guard_ran(out_dir)
    shards.canonicalize_folder(out_dir)
    log.info(
        "img2dataset: %.1f s; guard check and canonicalisation: %.1f s",
        fetched - start,
        time.perf_counter() - fetched,
    )


def check_guard_ran(out_dir: Path) -> None:
    """Fail unless every non-http(s) URL in the shards' parquets was refused by the guard (it ran in the workers)."""
    from stages import url_guard

    for parquet in sorted(out_dir.glob("*.parquet")):
        table = pq.read_table(parquet, columns=["url", "error_message"])
        for url, message in zip(table["url"].to_pylist(), table["error_message"].to_pylist(), strict=True):
            if url_guard.scheme_refusal(url) is not None and url_guard.REFUSED_SCHEME not in (message or ""):
                raise RuntimeError(
                    f"{parquet}: {url!r} was not refused by the URL guard ({message!r}); "
                    "the guard did not run in img2dataset's workers"
                )


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
    filtered, metadata_dir, out_dir = Path(filtered_dir) / OUTPUT_FILE, Path(metadata_dir), Path(out_dir)
    if not filtered.is_file():
        raise InputError(f"{filtered} not found (run filter_metadata first)")
    fetch = source.fetch
    rows = pl.scan_parquet(filtered).select(pl.len()).collect().item()
    archives = None if source.kind == "laion" else archive_listing(metadata_dir)
    prepare_out_dir(out_dir, fingerprint(filtered, fetch, archives))
    if rows == 0:
        log.warning("%s: %s has no rows; nothing to fetch", name, filtered)
    elif source.kind == "laion":
        with maybe_serve(serve):
            fetch_urls(filtered, out_dir, fetch, rows)
    else:
        reshard.run(filtered, metadata_dir, out_dir, fetch, name)
    if source.kind == "laion":
        from stages import url_guard

        metrics = shards.summarize_stats(out_dir, url_guard.failure_reason, url_guard.REASONS)
    else:
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
