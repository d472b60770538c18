"""WebDataset shards in img2dataset's layout: naming, deterministic writing, stats, reading.

img2dataset's ``output_format="webdataset"`` writes, per shard ``NNNNN``:

* ``NNNNN.tar`` with ``KEY.jpg``, ``KEY.txt`` (caption) and ``KEY.json`` (metadata) per success;
* ``NNNNN.parquet`` with one row per *tried* sample (status, error_message, sizes, ...);
* ``NNNNN_stats.json`` with ``count``, ``successes``, ``failed_to_download``, ``failed_to_resize``.

Keys are ``shard_id * 10**ceil(log10(shard_size)) + index`` zero-padded (``compute_key`` in
img2dataset). This module writes the same layout for sources that are re-sharded locally,
rewrites img2dataset's output so that the same input gives the same bytes (DVC hashes it; shard by
shard, idempotently; error messages lose addresses, timestamps and temp paths: :func:`sanitize_error_message`),
tells finished shards from what a killed fetch left (:func:`discard_unfinished`)
and sums the stats into metrics (:func:`summarize_stats`).
"""

from __future__ import annotations

import functools
import io
import json
import math
import mmap
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sdforge.ingest.ustar import BLOCK, DIRECTORY, END_BLOCK, PAX_HEADER, REGULAR_TYPES, parse_header, pax_records
from sdforge.io import atomic_file, atomic_write_bytes

SHARD_DIGITS = 5
"""img2dataset's ``oom_shard_count``: shard names are 5-digit (``00000.tar``)."""

TAR_MTIME = 0.0
"""Fixed member mtime so that rewritten tars are byte-identical run to run."""

STATS_VOLATILE_KEYS = ("start_time", "end_time", "duration")
"""Keys of img2dataset's ``*_stats.json`` that differ run to run; dropped when canonicalising."""

FILES_CANONICAL = "files_canonical"
"""Set in a shard's stats once its tar and parquet are canonical but its stats not yet (img2dataset's
progress logger, still running, needs their timings); dropped with them."""

SHARD_FILE = re.compile(rf"(\d{{{SHARD_DIGITS}}})(?:\.tar|\.parquet|_stats\.json)")
"""A shard's three files: ``NNNNN.tar``, ``NNNNN.parquet``, ``NNNNN_stats.json``."""

IMG2DATASET_STATUSES = frozenset({"success", "failed_to_download", "failed_to_resize"})
STATUS_NAME = re.compile(r"[a-z][a-z0-9_]*")
"""A ``status_dict`` key that is a status (``unsafe_member``), not an error message (``HTTP Error 404: ...``)."""

ERROR_MESSAGE = "error_message"
"""The shard parquet's column with why a sample failed (free text from img2dataset, urllib, PIL, OpenCV, ...)."""
MAX_ERROR_CHARS = 1000
"""Longest ``error_message`` kept (a library's or a server's text; the guard's and the decoder's are shorter)."""

_OBJECT_ADDRESS = re.compile(r"(<[^<>]*?) at 0x[0-9a-fA-F]+(?=>)")
"""``<_io.BytesIO object at 0x7f3a...>``: an object's repr; the address goes, the type stays."""
_BARE_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{9,}\b")
"""Any other 64-bit pointer (9+ hex digits: a CRC or a byte value such as ``0xff`` stays)."""
_TIMESTAMP = re.compile(
    r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?(?:Z|[+-]\d{2}:?\d{2})?(?![\w:])"
    r"|\b(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun), \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT\b"
)
"""ISO 8601 and HTTP dates (``2024-05-01T12:00:03.1Z``, ``Wed, 01 May 2024 12:00:03 GMT``)."""
_PATH_START = r"(?<![\w./:~-])"
"""An absolute path starts the message or follows a space, quote or bracket (not inside a URL: ``http://h/tmp``)."""
_PATH_REST = r"(?:/[^\s'\"<>()\[\],;:]*)?"


def _temp_roots() -> list[str]:
    """Temp folders whose paths are run-dependent (``mkdtemp`` names, pytest's numbered folders), longest first."""
    roots = {tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"}
    roots |= {os.path.realpath(root) for root in roots}
    return sorted((root.rstrip("/") for root in roots if root.rstrip("/")), key=len, reverse=True)


@functools.cache
def _temp_path_pattern() -> re.Pattern[str]:
    """An absolute path in one of :func:`_temp_roots` (compiled once per process)."""
    return re.compile(_PATH_START + "(?:" + "|".join(map(re.escape, _temp_roots())) + r")(?![\w.~-])" + _PATH_REST)


def _temp_path(match: re.Match[str]) -> str:
    """``<tmp>/b.jpg`` for ``/tmp/pytest-of-u/pytest-7/test0/b.jpg``: the file's name stays, the run's folder goes."""
    name = match.group(0).rstrip("/").rsplit("/", 1)[-1]
    return "<tmp>/" + name if name and match.group(0).count("/") > 1 else "<tmp>"


def _relative_to_cwd(message: str) -> str:
    """Absolute paths under the working directory (the repository, in a DVC stage) made relative to it."""
    cwd = os.getcwd().rstrip("/")
    if not cwd or cwd in (tempfile.gettempdir(), "/tmp") or cwd not in message:
        return message
    return re.sub(_PATH_START + re.escape(cwd) + "/", "", message)


def sanitize_error_message(message: str | None) -> str | None:
    """``message`` without what differs between two fetches of the same inputs; None stays None.

    Shard parquets and stats are hashed by DVC, so an error message must be a function of the input
    only. Removed: memory addresses (``<_io.BytesIO object at 0x7f...>`` becomes ``<_io.BytesIO object>``,
    other 64-bit pointers ``<address>``), timestamps (``<time>``), paths in temp folders (``<tmp>/NAME``,
    the file name kept) and the working directory's prefix (paths become repository-relative). The
    rest (error class, errno, HTTP status, URLs with their ports, file names) is kept, and a message
    that has none of these comes back unchanged. It is also made one line (OpenCV's and some servers'
    messages run to several: whitespace runs become one space) of at most :data:`MAX_ERROR_CHARS`.
    Idempotent; applied to every source kind's shards by :func:`write_parquet_table` and :func:`write_stats`.
    """
    if message is None:
        return None
    clean = " ".join(message.split())
    if len(clean) > MAX_ERROR_CHARS:
        clean = clean[:MAX_ERROR_CHARS] + "…"
    clean = _OBJECT_ADDRESS.sub(r"\1", clean)
    clean = _BARE_ADDRESS.sub("<address>", clean)
    clean = _TIMESTAMP.sub("<time>", clean)
    clean = _temp_path_pattern().sub(_temp_path, clean)
    return _relative_to_cwd(clean)


def sanitize_error_messages(table: pa.Table) -> pa.Table:
    """``table`` with :func:`sanitize_error_message` applied to its ``error_message`` column (if any).

    The table itself comes back when nothing changes, so a clean shard's parquet keeps its bytes.
    """
    if ERROR_MESSAGE not in table.column_names:
        return table
    index = table.column_names.index(ERROR_MESSAGE)
    column = table.column(index)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return table
    values = column.to_pylist()
    clean = [sanitize_error_message(value) for value in values]
    if clean == values:
        return table
    return table.set_column(index, table.schema.field(index), pa.array(clean, type=column.type))


def sanitize_status_dict(stats: dict[str, Any]) -> dict[str, Any]:
    """``stats`` with its ``status_dict`` keys (img2dataset counts error messages there) sanitised.

    Keys that become equal are merged (their counts summed); statuses such as ``success`` stay as they are.
    """
    status_dict = stats.get("status_dict")
    if not isinstance(status_dict, dict):
        return stats
    merged: dict[str, Any] = {}
    for key, count in status_dict.items():
        clean = sanitize_error_message(key) if isinstance(key, str) else key
        merged[clean] = merged[clean] + count if clean in merged else count
    return {**stats, "status_dict": merged}


def shard_name(shard_id: int) -> str:
    """``00007`` for shard 7 (img2dataset's naming)."""
    return f"{shard_id:0{SHARD_DIGITS}d}"


def sample_key(index: int, shard_size: int) -> tuple[int, str]:
    """Shard id and zero-padded key of the ``index``-th input row, exactly as img2dataset computes them."""
    shard_id, offset = divmod(index, shard_size)
    oom_sample = math.ceil(math.log10(shard_size)) if shard_size > 1 else 0
    return shard_id, f"{shard_id * 10**oom_sample + offset:0{oom_sample + SHARD_DIGITS}d}"


TAR_MODE, TAR_USER = 0o444, "bigdata"
"""Member mode and owner: what ``webdataset.TarWriter`` writes (its defaults), so both give the same bytes."""


def _sample_members(samples: Iterable[dict[str, Any]]) -> Iterator[tuple[str, bytes]]:
    """``(KEY.ext, bytes)`` of ``samples`` sorted by key, extensions sorted (as ``TarWriter.write``)."""
    for sample in sorted(samples, key=lambda s: s["__key__"]):
        key = sample["__key__"]
        for ext in sorted(sample):
            if ext.startswith("_"):
                continue
            value = sample[ext]
            yield f"{key}.{ext}", value.encode() if isinstance(value, str) else value


def _tar_chunks(members: Iterable[tuple[str, bytes]]) -> Iterator[bytes]:
    """The bytes of an uncompressed tar of ``members`` (in order) in pieces, exactly as
    ``webdataset.TarWriter(mtime=TAR_MTIME)`` writes it: PAX headers, 512-byte blocks, a record-sized end."""
    offset = 0
    for name, data in members:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), TAR_MTIME, TAR_MODE
        info.uname = info.gname = TAR_USER
        header = info.tobuf(tarfile.PAX_FORMAT, tarfile.ENCODING, "surrogateescape")
        pad = -len(data) % tarfile.BLOCKSIZE
        yield header
        yield data
        if pad:
            yield b"\0" * pad
        offset += len(header) + len(data) + pad
    end = 2 * tarfile.BLOCKSIZE
    yield b"\0" * (end + -(offset + end) % tarfile.RECORDSIZE)


def tar_bytes(samples: Iterable[dict[str, Any]]) -> bytes:
    """A WebDataset tar of ``samples`` (``{"__key__": k, ext: bytes|str}``), sorted by key, fixed mtime."""
    return b"".join(_tar_chunks(_sample_members(samples)))


def _tar_index(buf: bytes | mmap.mmap) -> dict[str, dict[str, tuple[int, int]]] | None:
    """``{key: {ext: (data offset, size)}}`` of the regular files of an uncompressed ustar/PAX tar.

    The fast path (headers parsed by :mod:`sdforge.ingest.ustar`, data not touched); None for anything else
    (compressed, GNU long names or base-256 sizes, links, a bad checksum, truncated), which
    :func:`_read_tar_slow` then handles.
    """
    index: dict[str, dict[str, tuple[int, int]]] = {}
    pos, n, pax = 0, len(buf), {}
    try:
        while pos + BLOCK <= n:
            header = buf[pos : pos + BLOCK]
            if header == END_BLOCK:
                return index
            if header[124] & 0x80:
                return None  # a GNU base-256 size: rare enough for the slow path
            size, kind, name = parse_header(header)
            data_at = pos + BLOCK
            pos = data_at + size + -size % BLOCK
            if data_at + size > n:
                return None
            if kind == PAX_HEADER:
                pax = pax_records(buf[data_at : data_at + size])
                continue
            if kind == DIRECTORY:
                pax = {}
                continue
            if kind not in REGULAR_TYPES:
                return None
            if b"size" in pax:
                return None  # a size beyond ustar's: rare enough for the slow path
            name = (pax.get(b"path") or name).decode(tarfile.ENCODING, "surrogateescape")
            pax = {}
            key, _, ext = name.partition(".")
            index.setdefault(key, {})[ext] = (data_at, size)
    except ValueError:
        return None
    return None  # no end-of-archive blocks: truncated


def _read_tar_slow(path: str | Path) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, _, ext = member.name.partition(".")
            fh = tar.extractfile(member)
            assert fh is not None
            samples.setdefault(key, {})[ext] = fh.read()
    return samples


def read_tar(path: str | Path) -> dict[str, dict[str, bytes]]:
    """All samples of a WebDataset tar: ``{key: {ext: bytes}}`` (ext without the dot)."""
    raw = Path(path).read_bytes()
    index = _tar_index(raw)
    if index is None:
        return _read_tar_slow(path)
    return {key: {ext: raw[at : at + size] for ext, (at, size) in exts.items()} for key, exts in index.items()}


def iter_samples(folder: str | Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Every ``(key, {ext: bytes})`` of every ``*.tar`` in ``folder``, in shard then key order."""
    for tar_path in sorted(Path(folder).glob("*.tar")):
        samples = read_tar(tar_path)
        for key in sorted(samples):
            yield key, samples[key]


def _write_if_changed(path: str | Path, data: bytes) -> None:
    """Atomically write ``data`` unless ``path`` already holds exactly these bytes (canonical already)."""
    path = Path(path)
    if not (path.is_file() and path.stat().st_size == len(data) and path.read_bytes() == data):
        atomic_write_bytes(path, data)


def _write_chunks_atomically(path: Path, chunks: Iterable[bytes]) -> None:
    """Stream ``chunks`` to a temp file beside ``path``, fsync it, rename it over ``path``."""
    with atomic_file(path) as fh:
        for chunk in chunks:
            fh.write(chunk)


def canonicalize_tar(path: str | Path) -> int:
    """Rewrite a tar with its samples sorted by key and a fixed mtime; return its sample count.

    Idempotent: a tar that is canonical already is left untouched (not even rewritten). The tar is
    memory-mapped and the new one streamed, one member at a time: a 10,000-image shard does not
    have to fit in memory (this runs in every fetch worker).
    """
    path = Path(path)
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            raise tarfile.ReadError(f"{path}: empty file, not a tar")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            index = _tar_index(mm)
            if index is None:
                samples = _read_tar_slow(path)
                _write_if_changed(path, tar_bytes({"__key__": k, **v} for k, v in samples.items()))
                return len(samples)
            order = [
                (f"{key}.{ext}", at, size) for key in sorted(index) for ext, (at, size) in sorted(index[key].items())
            ]

            def chunks() -> Iterator[bytes]:
                return _tar_chunks((name, mm[at : at + size]) for name, at, size in order)

            pos, same = 0, True
            for chunk in chunks():
                if mm[pos : pos + len(chunk)] != chunk:
                    same = False
                    break
                pos += len(chunk)
            if not (same and pos == len(mm)):
                _write_chunks_atomically(path, chunks())
    return len(index)


def canonicalize_parquet(path: str | Path, sort_key: str = "key") -> None:
    """Rewrite a shard's parquet sorted by ``sort_key`` (img2dataset writes rows as threads finish), its
    error messages sanitised (:func:`write_parquet_table`)."""
    table = pq.read_table(path)
    if sort_key in table.column_names and table.num_rows:
        table = table.sort_by(sort_key)
    write_parquet_table(path, table)


def write_parquet_table(path: str | Path, table: pa.Table) -> None:
    """Atomically write ``table`` as parquet, ``error_message`` sanitised (:func:`sanitize_error_messages`)."""
    buf = io.BytesIO()
    pq.write_table(sanitize_error_messages(table), buf)
    _write_if_changed(path, buf.getvalue())


def canonicalize_stats(path: str | Path) -> dict[str, Any]:
    """Drop run-dependent timings from a ``*_stats.json`` and rewrite it with sorted keys; return it."""
    stats = json.loads(Path(path).read_text())
    for key in (*STATS_VOLATILE_KEYS, FILES_CANONICAL):
        stats.pop(key, None)
    write_stats(path, stats)
    return stats


def write_stats(path: str | Path, stats: dict[str, Any]) -> None:
    """Write a shard's stats JSON (img2dataset's keys) deterministically, ``status_dict`` sanitised."""
    _write_if_changed(path, (json.dumps(sanitize_status_dict(stats), indent=4, sort_keys=True) + "\n").encode())


def canonicalize_shard(folder: str | Path, shard_id: int, final: bool = True) -> None:
    """Make one finished img2dataset shard deterministic: its tar, then its parquet, then its stats.

    The stats go last, so a shard whose stats carry no timings is canonical as a whole. With
    ``final=False`` (in a fetch worker, while img2dataset's logger may still read the stats) the
    stats keep their timings and get :data:`FILES_CANONICAL` instead. Idempotent.
    """
    folder, name = Path(folder), shard_name(shard_id)
    stats_path = folder / f"{name}_stats.json"
    canonicalize_tar(folder / f"{name}.tar")
    canonicalize_parquet(folder / f"{name}.parquet")
    if final:
        canonicalize_stats(stats_path)
    else:
        stats = json.loads(stats_path.read_text())
        atomic_write_bytes(stats_path, json.dumps({**stats, FILES_CANONICAL: True}, indent=4).encode())


def canonicalize_folder(folder: str | Path) -> None:
    """Make an img2dataset webdataset output folder deterministic: every finished shard not canonical yet.

    A shard is finished when its ``*_stats.json`` parses, and canonical when those stats carry no
    timings (:func:`canonicalize_shard` rewrites them last); canonical shards are not read again, and
    shards marked :data:`FILES_CANONICAL` only get their stats rewritten.
    """
    folder = Path(folder)
    for stats_path in sorted(folder.glob("*_stats.json")):
        match = SHARD_FILE.fullmatch(stats_path.name)
        stats = read_stats(stats_path)
        if not match or stats is None or not any(key in stats for key in STATS_VOLATILE_KEYS):
            continue
        if stats.get(FILES_CANONICAL):
            canonicalize_stats(stats_path)
        else:
            canonicalize_shard(folder, int(match.group(1)))


def read_stats(path: str | Path) -> dict[str, Any] | None:
    """A shard's ``*_stats.json``, or None when it is missing, truncated or not img2dataset's shape."""
    try:
        stats = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return stats if isinstance(stats, dict) and isinstance(stats.get("count"), int) else None


def discard_unfinished(folder: str | Path, keep: Iterable[str] = ()) -> list[str]:
    """Delete everything in ``folder`` but finished shards and the names in ``keep``; return what went.

    A shard is finished when its ``NNNNN_stats.json`` parses (img2dataset writes it after closing the
    shard's tar and parquet) and its tar and parquet are there. A killed fetch leaves the tar and
    parquet of the shards in flight without stats (truncated), img2dataset's ``_tmp/`` and
    ``atomic_write_bytes`` temporaries; all of them go, so that img2dataset's incremental mode (which
    counts a shard done when a ``*.json`` of its number exists) redoes exactly the unfinished shards.
    """
    folder, keep = Path(folder), set(keep)
    finished = {
        match.group(1)
        for path in folder.glob("*_stats.json")
        if (match := SHARD_FILE.fullmatch(path.name)) and read_stats(path) is not None
    }
    finished = {s for s in finished if (folder / f"{s}.tar").is_file() and (folder / f"{s}.parquet").is_file()}
    removed = []
    for path in sorted(folder.iterdir()):
        match = SHARD_FILE.fullmatch(path.name)
        if path.name in keep or (match and match.group(1) in finished and path.is_file()):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path.name)
    return removed


def finished_shards(folder: str | Path) -> list[int]:
    """Ids of the shards of ``folder`` whose ``*_stats.json`` parses, sorted."""
    folder = Path(folder)
    return sorted(
        int(match.group(1))
        for path in folder.glob("*_stats.json")
        if (match := SHARD_FILE.fullmatch(path.name)) and read_stats(path) is not None
    )


def summarize_stats(
    folder: str | Path,
    classify: Callable[[str | None], str] | None = None,
    reasons: Iterable[str] = (),
) -> dict[str, Any]:
    """Sum every ``*_stats.json`` of ``folder`` into the fetch metrics.

    Keys: ``samples`` (rows tried), ``successes``, ``failed_to_download``, ``failed_to_resize``,
    ``success_rate`` (successes / samples, 0 when nothing was tried) and ``shards`` (tar files);
    ``skipped_<status>`` for every other *status* found in a shard's ``status_dict`` (an identifier
    such as ``unsafe_member``, ``too_large``, ``duplicate``; img2dataset's free-text error messages,
    which it also keeps there, are not statuses). With ``classify`` (error message → reason), also
    one count per reason over the failed rows of the shards' parquets, every key of ``reasons``
    present (0 when none).
    """
    folder = Path(folder)
    totals = {"samples": 0, "successes": 0, "failed_to_download": 0, "failed_to_resize": 0}
    skipped: dict[str, int] = {}
    stats_paths = sorted(folder.glob("*_stats.json"))
    for stats_path in stats_paths:
        stats = json.loads(stats_path.read_text())
        totals["samples"] += int(stats.get("count", 0))
        for key in ("successes", "failed_to_download", "failed_to_resize"):
            totals[key] += int(stats.get(key, 0))
        for status, count in (stats.get("status_dict") or {}).items():
            if STATUS_NAME.fullmatch(status) and status not in IMG2DATASET_STATUSES:
                skipped[f"skipped_{status}"] = skipped.get(f"skipped_{status}", 0) + int(count)
    rate = totals["successes"] / totals["samples"] if totals["samples"] else 0.0
    metrics: dict[str, Any] = {
        **totals,
        "success_rate": round(rate, 6),
        "shards": len(list(folder.glob("*.tar"))),
        **dict(sorted(skipped.items())),
    }
    if classify is not None:
        counts = dict.fromkeys(reasons, 0)
        for stats_path in stats_paths:
            parquet = stats_path.with_name(stats_path.name.removesuffix("_stats.json") + ".parquet")
            if not parquet.is_file():
                continue
            table = pq.read_table(parquet, columns=["status", "error_message"])
            for status, message in zip(table["status"].to_pylist(), table["error_message"].to_pylist(), strict=True):
                if status != "success":
                    reason = classify(message)
                    counts[reason] = counts.get(reason, 0) + 1
        metrics.update(counts)
    return metrics
