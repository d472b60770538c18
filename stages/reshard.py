"""Re-shard images that are already on disk (archives or loose files) into WebDataset shards.

Used by ``fetch_images`` for every source kind except ``laion``. The rows of ``filtered.parquet``
(:mod:`stages.sources.rows`: ``archive, member, caption, meta``) name the images; each is checked
(header size before decoding), decoded to RGB, resized like img2dataset and JPEG-encoded. Shards
use img2dataset's layout and key scheme (``NNNNN.tar``, ``.parquet``, ``_stats.json``).

Plan. Rows sorted by ``(archive, member)`` fill shards of ``fetch.shard_size`` in order; the rows
of a tar archive (``.tar``, ``.tgz``, ``.tar.gz``, ...) start a shard of their own, so that one
worker streams that archive once (``r|*``, no random access into a compressed tar) and writes its
shards. Zip members and loose files are read at random, one worker task per shard. Shard ids and
keys come from the plan alone: the output does not depend on ``fetch.processes``.

Writing. Converted JPEGs go to a spill file while a shard fills; then ``NNNNN.tar`` (samples sorted
by key), ``NNNNN.parquet`` and, last, ``NNNNN_stats.json`` are each written under a temporary name
and renamed. A shard is complete when its stats file exists. A rerun over the same ``out_dir``
deletes temporaries and shards without stats, keeps the complete ones and redoes the rest.

Statuses (the parquet's ``status`` and ``status_dict``): ``success``; ``failed_to_download`` (member,
file or archive missing or unreadable); ``failed_to_resize`` (zero-byte, truncated, corrupt or
unknown image format); ``too_large`` (header pixels > ``fetch.max_image_pixels``, or a file larger
than :data:`MAX_BYTES_PER_PIXEL` × that); ``too_small`` (below the size rules the filter stored);
``unsafe_member`` (a path with ``..`` or absolute, a tar symlink/hardlink/device, a loose file
resolving outside the source folder); ``duplicate`` (the same member twice among the rows or in
the archive). Nothing is ever extracted to disk: member names are only looked up.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import tarfile
import tempfile
import zipfile
import zlib
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import polars as pl
import pyarrow as pa
import webdataset as wds

from stages import shards
from stages.common import InputError
from stages.config import FetchSettings
from stages.sources.images import ImageRejected, decode_rgb
from stages.sources.rows import ROW_COLUMNS, inside, reshard_checks, safe_member

log = logging.getLogger(__name__)

STREAM_SUFFIXES = (".tar", ".tgz", ".tar.gz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz")
ZIP_SUFFIXES = (".zip",)
MAX_BYTES_PER_PIXEL = 8
"""A file over ``max_image_pixels × 8`` bytes (16-bit RGBA, uncompressed) is refused unread."""

PARQUET_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("caption", pa.string()),
        ("source", pa.string()),
        ("archive", pa.string()),
        ("member", pa.string()),
        ("meta", pa.string()),
        ("status", pa.string()),
        ("error_message", pa.string()),
        ("width", pa.int64()),
        ("height", pa.int64()),
        ("original_width", pa.int64()),
        ("original_height", pa.int64()),
        ("sha256", pa.string()),
    ]
)
_SHARD_FILE = re.compile(r"^(\d+)(\.tar|\.parquet|_stats\.json)$")
_READ_ERRORS = (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, zlib.error, NotImplementedError, RuntimeError)


@dataclass(frozen=True)
class Item:
    """One filtered row with its sample key."""

    key: str
    archive: str | None
    member: str | None
    caption: str
    meta: str


@dataclass(frozen=True)
class ShardPlan:
    shard_id: int
    archive: str | None
    """The tar archive every item comes from, or None (zip members / loose files, read at random)."""
    items: tuple[Item, ...]


def is_stream_archive(archive: str | None) -> bool:
    return archive is not None and archive.lower().endswith(STREAM_SUFFIXES)


def archive_stem(archive: str) -> str:
    """``000`` for ``data/train/imgs/000.tgz``."""
    name = archive.rsplit("/", 1)[-1]
    for suffix in sorted(STREAM_SUFFIXES + ZIP_SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


# ---------------------------------------------------------------- image conversion


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


def convert(
    data: bytes, fetch: FetchSettings, min_width: int | None = None, min_height: int | None = None
) -> tuple[bytes, tuple[int, int], tuple[int, int]]:
    """Check, decode, resize and JPEG-encode one image; return ``(jpeg, (w, h), (orig_w, orig_h))``.

    Raises :class:`ImageRejected` (``failed_to_resize``, ``too_large``, ``too_small``).
    """
    draft = fetch.image_size if fetch.resize_mode != "no" else None
    rgb, original = decode_rgb(data, fetch.max_image_pixels, min_width, min_height, draft_size=draft)
    out = resize(np.ascontiguousarray(rgb[:, :, ::-1]), fetch.image_size, fetch.resize_mode)
    ok, buf = cv2.imencode(".jpg", out, [cv2.IMWRITE_JPEG_QUALITY, fetch.encode_quality])
    if not ok:
        raise ImageRejected("failed_to_resize", "JPEG encoding failed")
    return buf.tobytes(), (out.shape[1], out.shape[0]), original


# ---------------------------------------------------------------- one shard


class ShardWriter:
    """Collects one shard's results (any order), then writes tar, parquet and stats atomically."""

    def __init__(self, out_dir: Path, plan: ShardPlan, source: str, fetch: FetchSettings, checks: dict):
        self.out_dir, self.plan, self.source, self.fetch, self.checks = out_dir, plan, source, fetch, checks
        self.name = shards.shard_name(plan.shard_id)
        self.records: dict[str, dict[str, Any]] = {}
        self.samples: dict[str, tuple[int, int, str]] = {}  # key → (offset, length) in the spill, sample json
        self.spill_path = out_dir / f".{self.name}.spill.tmp"
        self.spill = self.spill_path.open("wb")

    def _record(self, item: Item, status: str, error: str | None) -> dict[str, Any]:
        return {
            "key": item.key,
            "caption": item.caption,
            "source": self.source,
            "archive": item.archive,
            "member": item.member,
            "meta": item.meta,
            "status": status,
            "error_message": error,
            "width": None,
            "height": None,
            "original_width": None,
            "original_height": None,
            "sha256": None,
        }

    def reject(self, item: Item, status: str, error: str) -> None:
        """``item`` gets no sample (a later call for the same item overrides an earlier one)."""
        self.records[item.key] = self._record(item, status, error)
        self.samples.pop(item.key, None)

    def add(self, item: Item, data: bytes) -> None:
        """Convert ``data`` for ``item``: a sample, or a rejection with its status."""
        try:
            jpeg, (w, h), (ow, oh) = convert(data, self.fetch, self.checks["min_width"], self.checks["min_height"])
        except ImageRejected as err:
            self.reject(item, err.status, err.message)
            return
        record = self._record(item, "success", None)
        record |= {"width": w, "height": h, "original_width": ow, "original_height": oh}
        record["sha256"] = hashlib.sha256(data).hexdigest()
        meta = {k: v for k, v in json.loads(item.meta).items() if k not in record}
        sample_json = json.dumps(meta | {k: v for k, v in record.items() if k != "meta"}, indent=4, sort_keys=True)
        offset = self.spill.tell()
        self.spill.write(jpeg)
        self.records[item.key] = record
        self.samples[item.key] = (offset, len(jpeg), sample_json)

    def finish(self) -> None:
        """Write ``NNNNN.tar``, ``.parquet``, then ``_stats.json`` (the completion marker)."""
        self.spill.close()
        missing = [item for item in self.plan.items if item.key not in self.records]
        for item in missing:  # a programming error upstream; never silently lose a row
            self.reject(item, "failed_to_download", "row was not processed")
        _write_tar(self.out_dir / f"{self.name}.tar", self.spill_path, self.samples, self.records)
        self.spill_path.unlink()
        records = [self.records[item.key] for item in self.plan.items]
        shards.write_parquet_table(self.out_dir / f"{self.name}.parquet", pa.Table.from_pylist(records, PARQUET_SCHEMA))
        statuses = Counter(r["status"] for r in records)
        stats = {
            "count": len(records),
            "successes": statuses.get("success", 0),
            "failed_to_download": statuses.get("failed_to_download", 0),
            "failed_to_resize": statuses.get("failed_to_resize", 0),
            "status_dict": dict(sorted(statuses.items())),
        }
        shards.write_stats(self.out_dir / f"{self.name}_stats.json", stats)


def _write_tar(path: Path, spill: Path, samples: dict[str, tuple[int, int, str]], records: dict) -> None:
    """The shard tar (samples sorted by key, fixed mtime) via a temp file and rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh, spill.open("rb") as src:
            writer = wds.TarWriter(fh, encoder=False, mtime=shards.TAR_MTIME)
            for key in sorted(samples):
                offset, length, sample_json = samples[key]
                src.seek(offset)
                caption = records[key]["caption"] or ""
                writer.write(
                    {"__key__": key, "jpg": src.read(length), "txt": caption.encode(), "json": sample_json.encode()}
                )
            writer.close()
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- reading members


class _Reject(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def checked_file(root: Path, rel: str, what: str) -> Path:
    """``root / rel`` when it is a regular file inside ``root`` (symlinks followed), else :class:`_Reject`."""
    path = root / rel
    if not inside(path, root):
        raise _Reject("unsafe_member", f"{what} {rel} resolves outside the source folder")
    if not path.exists():
        raise _Reject("failed_to_download", f"{what} {rel} not found")
    if not stat.S_ISREG(path.stat().st_mode):
        raise _Reject("unsafe_member", f"{what} {rel} is not a regular file")
    return path


class RandomReader:
    """Bytes of zip members and loose files under ``root``, each checked before it is read."""

    def __init__(self, root: Path, max_bytes: int):
        self.root, self.max_bytes = root, max_bytes
        self.zips: dict[str, zipfile.ZipFile | _Reject] = {}
        self.zip_names: dict[str, Counter] = {}

    def close(self) -> None:
        for zf in self.zips.values():
            if isinstance(zf, zipfile.ZipFile):
                zf.close()

    def _zip(self, archive: str) -> zipfile.ZipFile:
        if archive not in self.zips:
            try:
                zf = zipfile.ZipFile(checked_file(self.root, archive, "archive"))
                self.zip_names[archive] = Counter(zf.namelist())
                self.zips[archive] = zf
            except _Reject as err:
                self.zips[archive] = err
            except (zipfile.BadZipFile, OSError) as err:
                self.zips[archive] = _Reject("failed_to_download", f"archive {archive} unreadable ({err})")
        zf = self.zips[archive]
        if isinstance(zf, _Reject):
            raise zf
        return zf

    def read(self, item: Item) -> bytes:
        if item.archive is None:
            path = checked_file(self.root, item.member, "file")
            _check_bytes(path.stat().st_size, self.max_bytes)
            try:
                return path.read_bytes()
            except OSError as err:
                raise _Reject("failed_to_download", f"cannot read {item.member} ({err})") from None
        zf = self._zip(item.archive)
        try:
            info = zf.getinfo(item.member)
        except KeyError:
            raise _Reject("failed_to_download", "member not in archive") from None
        if stat.S_ISLNK(info.external_attr >> 16):
            raise _Reject("unsafe_member", "zip member is a symlink")
        if info.is_dir():
            raise _Reject("failed_to_download", "zip member is a directory")
        if self.zip_names[item.archive][item.member] > 1:
            raise _Reject("duplicate", "member name appears more than once in the archive")
        _check_bytes(info.file_size, self.max_bytes)
        try:
            return zf.read(info)
        except _READ_ERRORS as err:
            raise _Reject("failed_to_download", f"corrupt zip member ({type(err).__name__}: {err})") from None


def _check_bytes(size: int, max_bytes: int) -> None:
    if size > max_bytes:
        raise _Reject(
            "too_large", f"file of {size} bytes > {max_bytes} (fetch.max_image_pixels x {MAX_BYTES_PER_PIXEL})"
        )


def _tar_member_problem(info: tarfile.TarInfo) -> str | None:
    if info.issym():
        return "tar member is a symlink"
    if info.islnk():
        return "tar member is a hardlink"
    if not info.isreg():
        return "tar member is not a regular file"
    return None


def _close_quietly(tar: tarfile.TarFile) -> None:
    with contextlib.suppress(*_READ_ERRORS):
        tar.close()


def stream_tar(path: Path, archive: str, writers: dict[str, ShardWriter], items: dict[str, Item], max_bytes: int):
    """Stream ``path`` once; feed the members that ``items`` (member → item) name to their writers.

    A member is matched by its name without a leading ``./``, or prefixed with the archive's stem
    (``000.tgz`` holding ``x.jpg`` serves member ``000/x.jpg``). Read errors end the stream: the
    rows not seen by then are ``failed_to_download`` with the error.
    """
    stem, seen, unsafe_names, error = archive_stem(archive), set(), 0, None
    try:
        tar = tarfile.open(path, "r|*")
    except _READ_ERRORS as err:
        tar, error = None, f"archive unreadable ({type(err).__name__}: {err})"
    while tar is not None:
        try:
            info = tar.next()
            tar.members = []  # streaming: keep no index of the archive in memory
        except _READ_ERRORS as err:
            info, error = None, f"archive unreadable after {len(seen)} wanted members ({type(err).__name__}: {err})"
        if info is None:
            _close_quietly(tar)
            break
        name = safe_member(info.name)
        if name is None:
            unsafe_names += 1
            continue
        item = items.get(name) or items.get(f"{stem}/{name}")
        if item is None:
            continue
        writer = writers[item.key]
        if item.key in seen:
            writer.reject(item, "duplicate", "member appears more than once in the archive")
            continue
        seen.add(item.key)
        problem = _tar_member_problem(info)
        if problem:
            writer.reject(item, "unsafe_member", problem)
            continue
        if info.size > max_bytes:
            writer.reject(item, "too_large", f"member of {info.size} bytes > {max_bytes}")
            continue
        try:
            fh = tar.extractfile(info)
            assert fh is not None
            data = fh.read()
        except _READ_ERRORS as err:
            error = f"archive unreadable at {info.name} ({type(err).__name__}: {err})"
            seen.discard(item.key)
            _close_quietly(tar)
            break
        writer.add(item, data)
    if error:
        log.warning("%s: %s", archive, error)
    if unsafe_names:
        log.warning("%s: ignored %d members with unsafe names (absolute or '..')", archive, unsafe_names)
    for item in items.values():
        if item.key not in seen:
            writers[item.key].reject(item, "failed_to_download", error or "member not in archive")


# ---------------------------------------------------------------- tasks


def write_shards(
    plans: list[ShardPlan], metadata_dir: Path, out_dir: Path, fetch: FetchSettings, source: str, checks: dict
) -> None:
    """One worker task: a run of shards from one tar archive (streamed once), or one random-access shard."""
    max_bytes = fetch.max_image_pixels * MAX_BYTES_PER_PIXEL
    by_shard = {plan.shard_id: ShardWriter(out_dir, plan, source, fetch, checks) for plan in plans}
    writers = {item.key: by_shard[plan.shard_id] for plan in plans for item in plan.items}
    todo = [item for plan in plans for item in plan.items]
    first_of: dict[tuple[str | None, str | None], str] = {}
    valid = []
    for item in todo:  # rows the filter would never write, checked again (hand-edited parquet)
        if item.member is None or safe_member(item.member) != item.member:
            writers[item.key].reject(item, "unsafe_member", f"member path {item.member!r} refused")
        elif item.archive is not None and safe_member(item.archive) != item.archive:
            writers[item.key].reject(item, "unsafe_member", f"archive path {item.archive!r} refused")
        elif (item.archive, item.member) in first_of:
            writers[item.key].reject(item, "duplicate", f"same row as key {first_of[item.archive, item.member]}")
        else:
            first_of[item.archive, item.member] = item.key
            valid.append(item)
    archive = plans[0].archive
    if archive is not None:
        try:
            path = checked_file(metadata_dir, archive, "archive")
        except _Reject as err:
            for item in valid:
                writers[item.key].reject(item, err.status, err.message)
        else:
            stream_tar(path, archive, writers, {item.member: item for item in valid}, max_bytes)
    else:
        reader = RandomReader(metadata_dir, max_bytes)
        try:
            for item in valid:
                try:
                    data = reader.read(item)
                except _Reject as err:
                    writers[item.key].reject(item, err.status, err.message)
                else:
                    writers[item.key].add(item, data)
        finally:
            reader.close()
    for writer in by_shard.values():
        writer.finish()


def plan_shards(rows: list[dict[str, Any]], shard_size: int) -> list[ShardPlan]:
    """Rows (sorted) → shards; each tar archive's rows start a new shard. Keys: img2dataset's scheme."""
    plans: list[ShardPlan] = []
    current: list[dict[str, Any]] = []
    group: str | None = None

    def flush() -> None:
        shard_id = len(plans)
        items = tuple(
            Item(
                shards.sample_key(shard_id * shard_size + i, shard_size)[1],
                r["archive"],
                r["member"],
                r["caption"],
                r["meta"],
            )
            for i, r in enumerate(current)
        )
        plans.append(ShardPlan(shard_id, group, items))
        current.clear()

    for row in rows:
        row_group = row["archive"] if is_stream_archive(row["archive"]) else None
        if current and (row_group != group or len(current) == shard_size):
            flush()
        group = row_group
        current.append(row)
    if current:
        flush()
    return plans


def load_rows(filtered: Path) -> list[dict[str, Any]]:
    """The filtered rows, validated: the schema, a JSON-object ``meta``, a known archive type."""
    df = pl.read_parquet(filtered)
    missing = [c for c in ROW_COLUMNS if c not in df.columns]
    if missing:
        raise InputError(
            f"{filtered}: columns {missing} missing (has {df.columns}; expected {list(ROW_COLUMNS)}); "
            "re-run filter_metadata"
        )
    df = df.select(ROW_COLUMNS).with_columns(pl.col("caption").fill_null(""), pl.col("meta").fill_null("{}"))
    rows = df.sort(pl.col("archive").is_not_null(), "archive", "member", maintain_order=True).to_dicts()
    for i, row in enumerate(rows):
        try:
            meta = json.loads(row["meta"])
        except json.JSONDecodeError as err:
            raise InputError(f"{filtered}: row {i} (member {row['member']!r}): meta is not JSON ({err})") from None
        if not isinstance(meta, dict):
            raise InputError(f"{filtered}: row {i} (member {row['member']!r}): meta is not a JSON object")
        archive = row["archive"]
        if archive is not None and not archive.lower().endswith(STREAM_SUFFIXES + ZIP_SUFFIXES):
            raise InputError(
                f"{filtered}: row {i}: archive {archive!r} is neither a zip nor a tar ({', '.join(STREAM_SUFFIXES)})"
            )
    return rows


def complete_shards(out_dir: Path, shard_ids: set[int]) -> set[int]:
    """Make ``out_dir`` resumable: delete temporaries, shards without stats and shards not in the plan;
    return the ids of the complete shards (tar, parquet and a readable stats file)."""
    files: dict[int, list[Path]] = {}
    for path in sorted(out_dir.iterdir()):
        if path.is_file() and ".tmp" in path.name:
            path.unlink()
            continue
        match = _SHARD_FILE.match(path.name)
        if match:
            files.setdefault(int(match[1]), []).append(path)
    complete = set()
    for shard_id, paths in files.items():
        name = shards.shard_name(shard_id)
        stats = out_dir / f"{name}_stats.json"
        whole = (
            shard_id in shard_ids
            and len(paths) == 3
            and {p.name for p in paths}
            == {
                f"{name}.tar",
                f"{name}.parquet",
                stats.name,
            }
        )
        if whole:
            try:
                json.loads(stats.read_text())
            except (OSError, ValueError):
                whole = False
        if whole:
            complete.add(shard_id)
        else:
            stats.unlink(missing_ok=True)  # the completion marker goes first
            for path in paths:
                path.unlink(missing_ok=True)
    return complete


def run(filtered: Path, metadata_dir: Path, out_dir: Path, fetch: FetchSettings, source: str) -> None:
    """Re-shard the filtered rows' images into ``out_dir``; shards already complete there are kept."""
    rows = load_rows(filtered)
    checks = reshard_checks(filtered)
    plans = plan_shards(rows, fetch.shard_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = complete_shards(out_dir, {plan.shard_id for plan in plans})
    todo = [plan for plan in plans if plan.shard_id not in done]
    tasks: list[list[ShardPlan]] = []
    for plan in todo:
        if plan.archive is not None and tasks and tasks[-1][0].archive == plan.archive:
            tasks[-1].append(plan)
        else:
            tasks.append([plan])
    if done:
        log.info(
            "%s: %d of %d shards already complete in %s; writing %d", source, len(done), len(plans), out_dir, len(todo)
        )
    args = (metadata_dir, out_dir, fetch, source, checks)
    if fetch.processes > 1 and len(tasks) > 1:
        with ProcessPoolExecutor(min(fetch.processes, len(tasks)), mp_context=get_context("spawn")) as pool:
            futures = [pool.submit(write_shards, task, *args) for task in tasks]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
    else:
        for task in tasks:
            write_shards(task, *args)
