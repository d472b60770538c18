"""WebDataset shards in img2dataset's layout: naming, deterministic writing, stats, reading.

img2dataset's ``output_format="webdataset"`` writes, per shard ``NNNNN``:

* ``NNNNN.tar`` with ``KEY.jpg``, ``KEY.txt`` (caption) and ``KEY.json`` (metadata) per success;
* ``NNNNN.parquet`` with one row per *tried* sample (status, error_message, sizes, ...);
* ``NNNNN_stats.json`` with ``count``, ``successes``, ``failed_to_download``, ``failed_to_resize``.

Keys are ``shard_id * 10**ceil(log10(shard_size)) + index`` zero-padded (``compute_key`` in
img2dataset). This module writes the same layout for sources that are re-sharded locally, and
rewrites img2dataset's output so that the same input gives the same bytes (DVC hashes it).
"""

from __future__ import annotations

import io
import json
import math
import tarfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import webdataset as wds

from stages.common import atomic_write_bytes

SHARD_DIGITS = 5
"""img2dataset's ``oom_shard_count``: shard names are 5-digit (``00000.tar``)."""

TAR_MTIME = 0.0
"""Fixed member mtime so that rewritten tars are byte-identical run to run."""

STATS_VOLATILE_KEYS = ("start_time", "end_time", "duration")
"""Keys of img2dataset's ``*_stats.json`` that differ run to run; dropped when canonicalising."""


def shard_name(shard_id: int) -> str:
    """``00007`` for shard 7 (img2dataset's naming)."""
    return f"{shard_id:0{SHARD_DIGITS}d}"


def sample_key(index: int, shard_size: int) -> tuple[int, str]:
    """Shard id and zero-padded key of the ``index``-th input row, exactly as img2dataset computes them."""
    shard_id, offset = divmod(index, shard_size)
    oom_sample = math.ceil(math.log10(shard_size)) if shard_size > 1 else 0
    return shard_id, f"{shard_id * 10**oom_sample + offset:0{oom_sample + SHARD_DIGITS}d}"


def tar_bytes(samples: Iterable[dict[str, Any]]) -> bytes:
    """A WebDataset tar of ``samples`` (``{"__key__": k, ext: bytes|str}``), sorted by key, fixed mtime."""
    buf = io.BytesIO()
    with wds.TarWriter(buf, encoder=False, mtime=TAR_MTIME) as writer:
        for sample in sorted(samples, key=lambda s: s["__key__"]):
            writer.write({k: v.encode() if isinstance(v, str) and k != "__key__" else v for k, v in sample.items()})
    return buf.getvalue()


def read_tar(path: str | Path) -> dict[str, dict[str, bytes]]:
    """All samples of a WebDataset tar: ``{key: {ext: bytes}}`` (ext without the dot)."""
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


def iter_samples(folder: str | Path) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Every ``(key, {ext: bytes})`` of every ``*.tar`` in ``folder``, in shard then key order."""
    for tar_path in sorted(Path(folder).glob("*.tar")):
        samples = read_tar(tar_path)
        for key in sorted(samples):
            yield key, samples[key]


def canonicalize_tar(path: str | Path) -> int:
    """Rewrite a tar with its samples sorted by key and a fixed mtime; return its sample count."""
    samples = read_tar(path)
    atomic_write_bytes(path, tar_bytes({"__key__": k, **v} for k, v in samples.items()))
    return len(samples)


def canonicalize_parquet(path: str | Path, sort_key: str = "key") -> None:
    """Rewrite a shard's parquet sorted by ``sort_key`` (img2dataset writes rows as threads finish)."""
    table = pq.read_table(path)
    if sort_key in table.column_names and table.num_rows:
        table = table.sort_by(sort_key)
    write_parquet_table(path, table)


def write_parquet_table(path: str | Path, table: pa.Table) -> None:
    """Atomically write ``table`` as parquet."""
    buf = io.BytesIO()
    pq.write_table(table, buf)
    atomic_write_bytes(path, buf.getvalue())


def canonicalize_stats(path: str | Path) -> dict[str, Any]:
    """Drop run-dependent timings from a ``*_stats.json`` and rewrite it with sorted keys; return it."""
    stats = json.loads(Path(path).read_text())
    for key in STATS_VOLATILE_KEYS:
        stats.pop(key, None)
    write_stats(path, stats)
    return stats


def write_stats(path: str | Path, stats: dict[str, Any]) -> None:
    """Write a shard's stats JSON (img2dataset's keys) deterministically."""
    atomic_write_bytes(path, (json.dumps(stats, indent=4, sort_keys=True) + "\n").encode())


def canonicalize_folder(folder: str | Path) -> None:
    """Make an img2dataset webdataset output folder deterministic: tars, parquets and stats."""
    folder = Path(folder)
    for tar_path in sorted(folder.glob("*.tar")):
        canonicalize_tar(tar_path)
    for parquet_path in sorted(folder.glob("*.parquet")):
        canonicalize_parquet(parquet_path)
    for stats_path in sorted(folder.glob("*_stats.json")):
        canonicalize_stats(stats_path)


def summarize_stats(folder: str | Path) -> dict[str, Any]:
    """Sum every ``*_stats.json`` of ``folder`` into the fetch metrics.

    Keys: ``samples`` (rows tried), ``successes``, ``failed_to_download``, ``failed_to_resize``,
    ``success_rate`` (successes / samples, 0 when nothing was tried) and ``shards`` (tar files).
    """
    folder = Path(folder)
    totals = {"samples": 0, "successes": 0, "failed_to_download": 0, "failed_to_resize": 0}
    for stats_path in sorted(folder.glob("*_stats.json")):
        stats = json.loads(stats_path.read_text())
        totals["samples"] += int(stats.get("count", 0))
        for key in ("successes", "failed_to_download", "failed_to_resize"):
            totals[key] += int(stats.get(key, 0))
    rate = totals["successes"] / totals["samples"] if totals["samples"] else 0.0
    return {**totals, "success_rate": round(rate, 6), "shards": len(list(folder.glob("*.tar")))}
