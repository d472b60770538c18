"""Re-shard images that are already on disk (archives or loose files) into WebDataset shards.

Used by ``fetch_images`` for every source kind except ``laion``: the rows of ``filtered.parquet``
(written by the kind's adapter in :mod:`stages.sources`) name an archive and a member; each image
is decoded with OpenCV, converted to 8-bit BGR, resized like img2dataset and JPEG-encoded. Shards
use img2dataset's layout and key scheme (``NNNNN.tar``, ``.parquet``, ``_stats.json``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import zipfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import polars as pl
import pyarrow as pa

from stages import shards
from stages.common import atomic_write_bytes
from stages.config import FetchSettings


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
    ok, buf = cv2.imencode(".jpg", out, [cv2.IMWRITE_JPEG_QUALITY, fetch.encode_quality])
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


def run(filtered: Path, metadata_dir: Path, out_dir: Path, fetch: FetchSettings, source: str) -> None:
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
