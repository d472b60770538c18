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
import hashlib
import json
import logging
import os
import shutil
import zipfile
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import polars as pl
import pyarrow as pa

from stages import shards
from stages.common import InputError, atomic_write_bytes, stage_cli
from stages.config import FetchSettings, Params, Source
from stages.demo_http import serve_directory
from stages.filter_metadata import OUTPUT_FILE

# albumentations (imported by img2dataset) otherwise asks the package index for updates
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

log = logging.getLogger(__name__)

SUPPORTED_KINDS = frozenset({"laion", "diffusiondb"})

JPEG_QUALITY = 95
"""img2dataset's default ``encode_quality``."""


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
        encode_quality=JPEG_QUALITY,
        enable_wandb=False,
    )
    shards.canonicalize_folder(out_dir)


def to_bgr(img: np.ndarray) -> np.ndarray:
    """Any decoded image (gray, 16-bit, BGRA) as 8-bit BGR; alpha is composited onto white."""
    if img.dtype == np.uint16:
        img = (img >> 8).astype(np.uint8)
    if img.ndim == 2 or img.shape[2] == 1:
        return cv2.cvtColor(img, cv2.COLOR_GRAY2BGR)
    if img.shape[2] == 4:
        alpha = img[:, :, 3:4].astype(np.float32) / 255.0
        bgr = img[:, :, :3].astype(np.float32) * alpha + 255.0 * (1.0 - alpha)
        return np.clip(bgr + 0.5, 0, 255).astype(np.uint8)
    return img[:, :, :3]


def resize(img: np.ndarray, size: int, mode: str) -> np.ndarray:
    """img2dataset's resize modes: ``center_crop``/``keep_ratio`` scale the shorter side to ``size``
    (then crop the centre square, or not), ``border`` scales the longer side and pads with black."""
    if mode == "no":
        return img
    h, w = img.shape[:2]
    scale = size / (max(h, w) if mode == "border" else min(h, w))
    new_w, new_h = max(1, round(w * scale)), max(1, round(h * scale))
    if (new_w, new_h) != (w, h):
        interpolation = cv2.INTER_AREA if scale < 1 else cv2.INTER_LANCZOS4
        img = cv2.resize(img, (new_w, new_h), interpolation=interpolation)
    if mode == "center_crop":
        top, left = (new_h - size) // 2, (new_w - size) // 2
        img = img[top : top + size, left : left + size]
    elif mode == "border":
        dh, dw = size - new_h, size - new_w
        img = cv2.copyMakeBorder(
            img, dh // 2, dh - dh // 2, dw // 2, dw - dw // 2, cv2.BORDER_CONSTANT, value=(0, 0, 0)
        )
    return img


def convert(data: bytes, fetch: FetchSettings) -> tuple[bytes, tuple[int, int], tuple[int, int]]:
    """Decode, resize and JPEG-encode one image; return ``(jpeg, (w, h), (orig_w, orig_h))``.

    Raises ``ValueError`` when OpenCV cannot decode ``data``.
    """
    decoded = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
    if decoded is None or decoded.size == 0:
        raise ValueError("image decoding failed")
    bgr = to_bgr(decoded)
    out = resize(bgr, fetch.image_size, fetch.resize_mode)
    ok, buf = cv2.imencode(".jpg", out, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
    if not ok:
        raise ValueError("JPEG encoding failed")
    return buf.tobytes(), (out.shape[1], out.shape[0]), (bgr.shape[1], bgr.shape[0])


def archive_sample(row: dict[str, Any], key: str, zf: zipfile.ZipFile, fetch: FetchSettings, source: str):
    """One filtered DiffusionDB row → ``(tar sample or None, parquet row, status)``."""
    meta: dict[str, Any] = {
        "key": key,
        "caption": row["caption"],
        "source": source,
        "archive": row["archive"],
        "member": row["member"],
        "seed": row["seed"],
        "cfg": row["cfg"],
        "steps": row["steps"],
        "sampler": row["sampler"],
        "status": "success",
        "error_message": None,
        "width": None,
        "height": None,
        "original_width": None,
        "original_height": None,
        "sha256": None,
    }
    try:
        data = zf.read(row["member"])
    except KeyError:
        return None, {**meta, "status": "failed_to_download", "error_message": "member not in archive"}
    try:
        jpeg, (w, h), (ow, oh) = convert(data, fetch)
    except (ValueError, cv2.error) as err:
        return None, {**meta, "status": "failed_to_resize", "error_message": str(err)}
    meta |= {"width": w, "height": h, "original_width": ow, "original_height": oh}
    meta["sha256"] = hashlib.sha256(data).hexdigest()
    sample = {"__key__": key, "jpg": jpeg, "txt": row["caption"] or "", "json": json.dumps(meta, indent=4)}
    return sample, meta


def write_archive_shard(
    shard_id: int, rows: list[dict[str, Any]], metadata_dir: Path, out_dir: Path, fetch: FetchSettings, source: str
) -> None:
    """Write shard ``shard_id`` (tar, parquet, stats) from its rows; keys follow img2dataset's scheme."""
    samples, metas = [], []
    with contextlib.ExitStack() as stack:
        archives: dict[str, zipfile.ZipFile] = {}
        for offset, row in enumerate(rows):
            if row["archive"] not in archives:
                archives[row["archive"]] = stack.enter_context(zipfile.ZipFile(metadata_dir / row["archive"]))
            _, key = shards.sample_key(shard_id * fetch.shard_size + offset, fetch.shard_size)
            sample, meta = archive_sample(row, key, archives[row["archive"]], fetch, source)
            if sample is not None:
                samples.append(sample)
            metas.append(meta)
    name = shards.shard_name(shard_id)
    atomic_write_bytes(out_dir / f"{name}.tar", shards.tar_bytes(samples))
    shards.write_parquet_table(out_dir / f"{name}.parquet", pa.Table.from_pylist(metas))
    statuses = [m["status"] for m in metas]
    status_dict = {s: statuses.count(s) for s in sorted(set(statuses))}
    stats = {
        "count": len(metas),
        "successes": status_dict.get("success", 0),
        "failed_to_download": status_dict.get("failed_to_download", 0),
        "failed_to_resize": status_dict.get("failed_to_resize", 0),
        "status_dict": status_dict,
    }
    shards.write_stats(out_dir / f"{name}_stats.json", stats)


def fetch_archives(filtered: Path, metadata_dir: Path, out_dir: Path, fetch: FetchSettings, source: str) -> None:
    """Re-shard the filtered DiffusionDB rows' images (sorted by archive, member); shards in parallel."""
    rows = pl.read_parquet(filtered).sort("archive", "member").to_dicts()
    size = fetch.shard_size
    tasks = [(i // size, rows[i : i + size], metadata_dir, out_dir, fetch, source) for i in range(0, len(rows), size)]
    if fetch.processes > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(min(fetch.processes, len(tasks)), mp_context=get_context("spawn")) as pool:
            for future in [pool.submit(write_archive_shard, *task) for task in tasks]:
                future.result()
    else:
        for task in tasks:
            write_archive_shard(*task)


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
        fetch_archives(filtered, metadata_dir, out_dir, fetch, name)
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
