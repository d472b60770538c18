"""Re-shard images that are already on disk (archives or loose files) into WebDataset shards.

Used by ``fetch_images`` for every source kind except ``laion``. The rows of ``filtered.parquet``
(:mod:`sdforge.ingest.sources.rows`: ``archive, member, caption, meta``) name the images; each is read
(:mod:`sdforge.ingest.archive_members`), checked (header size before decoding), decoded to RGB, resized like
img2dataset and JPEG-encoded (:mod:`sdforge.ingest.image_convert`). Shards use img2dataset's layout and key
scheme (``NNNNN.tar``, ``.parquet``, ``_stats.json``); which row goes into which shard is
:mod:`sdforge.ingest.reshard_plan` (a tar archive's rows are streamed once by one worker; the output does
not depend on ``fetch.processes``).

Writing. Converted JPEGs go to a spill file while a shard fills; then ``NNNNN.tar`` (samples sorted
by key), ``NNNNN.parquet`` and, last, ``NNNNN_stats.json`` are each written under a temporary name
and renamed. A shard is complete when its stats file exists. A rerun over the same ``out_dir``
deletes temporaries and shards without stats, keeps the complete ones and redoes the rest.

Statuses (the parquet's ``status`` and ``status_dict``): ``success``; ``failed_to_download`` (member,
file or archive missing or unreadable); ``failed_to_resize`` (zero-byte, truncated, corrupt or
unknown image format, or any library error while decoding, resizing or encoding); ``too_large`` (header
pixels > ``fetch.max_image_pixels``, the image once resized over that many pixels or over 65,500 px a
side, or a file larger than :data:`~sdforge.bounds.images.MAX_BYTES_PER_PIXEL` × that);
``too_small`` (below the size rules the filter stored); ``unsafe_member`` (a path with ``..`` or absolute, a tar
symlink/hardlink/device, a loose file resolving outside the source folder); ``duplicate`` (the same
member twice among the rows or in the archive). Nothing is ever extracted to disk: member names are
only looked up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import pyarrow as pa

from sdforge.bounds.images import MAX_BYTES_PER_PIXEL
from sdforge.config import FetchSettings
from sdforge.ingest import shards
from sdforge.ingest.archive_members import MemberRejected, RandomReader, checked_file, stream_tar
from sdforge.ingest.image_convert import convert
from sdforge.ingest.reshard_plan import Item, ShardPlan, load_rows, plan_shards
from sdforge.ingest.sources.images import ImageRejected
from sdforge.ingest.sources.rows import reshard_checks, safe_member
from sdforge.io import atomic_file, naming_write_faults

log = logging.getLogger(__name__)

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


# ---------------------------------------------------------------- one shard


class ShardWriter:
    """Collects one shard's results (any order), then writes tar, parquet and stats atomically."""

    def __init__(self, out_dir: Path, plan: ShardPlan, source: str, fetch: FetchSettings, checks: dict):
        self.out_dir, self.plan, self.source, self.fetch, self.checks = out_dir, plan, source, fetch, checks
        self.name = shards.shard_name(plan.shard_id)
        self.records: dict[str, dict[str, Any]] = {}
        self.samples: dict[str, tuple[int, int, str]] = {}  # key → (offset, length) in the spill, sample json
        self.spill_path = out_dir / f".{self.name}.spill.tmp"
        with self._faults_named():
            self.spill = self.spill_path.open("wb")

    def _faults_named(self):
        """A write fault in the shard's files named (:class:`~sdforge.io.OutputError`)."""
        kept = "complete shards are kept: a rerun writes only the others"
        return naming_write_faults(self.out_dir / f"{self.name}.tar", "the shard", setting="paths.shards", kept=kept)

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
        with self._faults_named():
            self.spill.write(jpeg)
        self.records[item.key] = record
        self.samples[item.key] = (offset, len(jpeg), sample_json)

    def finish(self) -> None:
        """Write ``NNNNN.tar``, ``.parquet``, then ``_stats.json`` (the completion marker)."""
        with self._faults_named():
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
    import webdataset as wds  # lazy (~1.5 s): a fetch that writes no shard does not pay for it

    with atomic_file(path) as fh, spill.open("rb") as src:
        writer = wds.TarWriter(fh, encoder=False, mtime=shards.TAR_MTIME)
        for key in sorted(samples):
            offset, length, sample_json = samples[key]
            src.seek(offset)
            caption = records[key]["caption"] or ""
            writer.write(
                {"__key__": key, "jpg": src.read(length), "txt": caption.encode(), "json": sample_json.encode()}
            )
        writer.close()


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
        except MemberRejected as err:
            for item in valid:
                writers[item.key].reject(item, err.status, err.message)
        else:
            by_member = {item.member: item for item in valid}
            for member, result in stream_tar(path, archive, by_member, max_bytes):
                item = by_member[member]
                if isinstance(result, MemberRejected):
                    writers[item.key].reject(item, result.status, result.message)
                else:
                    writers[item.key].add(item, result)
    else:
        reader = RandomReader(metadata_dir, max_bytes)
        try:
            for item in valid:
                try:
                    data = reader.read(item.archive, item.member)
                except MemberRejected as err:
                    writers[item.key].reject(item, err.status, err.message)
                else:
                    writers[item.key].add(item, data)
        finally:
            reader.close()
    for writer in by_shard.values():
        writer.finish()


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


def run(
    filtered: Path,
    metadata_dir: Path,
    out_dir: Path,
    fetch: FetchSettings,
    source: str,
    caption_max_chars: int | None = None,
) -> None:
    """Re-shard the filtered rows' images into ``out_dir``; shards already complete there are kept. Captions
    are cut to ``caption_max_chars`` (:func:`~sdforge.ingest.reshard_plan.load_rows`)."""
    rows = load_rows(filtered, caption_max_chars)
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
