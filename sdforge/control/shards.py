"""Conditioning images beside the latents, one file per latent shard file: what ``condition_images`` writes and a
ControlNet phase reads (docs/CONTROL.md).

Layout, per source, resolution and kind: ``<conditions>/<source>/<resolution>/<kind>/``
- ``shard-NNNNN-WxH.safetensors`` for each bucket file of latent shard NNNNN: ``<kind>`` ``uint8 [N, ⌈W·H/8⌉]`` (the
  edge map of row ``r`` of the latent file, bit-packed: :func:`sdforge.control.edges.pack_edges`) and ``valid``
  ``uint8 [N]`` (0: the sample was skipped and has no condition; the marker says why);
- ``shard-NNNNN.json``, written last (the shard is done): the latent part it was made from (its sha256), the settings'
  fingerprint, the bucket files, the count of conditions, and each skipped sample's key and reason.

Each sample is decoded from the input tar and cropped by the encoder's own code (:func:`decode_sample` with the
resolution's buckets), then checked against the bucket and crop box its latent's manifest row records: the condition
shows exactly the pixels the latent encodes, or the sample is skipped and named (never a crash, never a silent gap).
A shard is redone when its latent part, the settings or OpenCV's version change (content-keyed like the latents).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
from safetensors.numpy import save

from sdforge.control.edges import canny_edges, pack_edges
from sdforge.ingest.buckets import Size
from sdforge.io import atomic_write_bytes, write_json
from sdforge.latents import store
from sdforge.latents.inputs import Decoded, decode_sample, iter_tar_groups

log = logging.getLogger(__name__)

FORMAT = "1"
SKIP_REASONS = ("missing", "undecodable", "crop_mismatch")
"""Why a latent has no condition: its sample is not in the tar, does not decode, or decodes to another crop."""
CHUNK = 32
"""Samples decoded and edge-detected per pool job."""


@dataclass(frozen=True)
class DecodeRules:
    """How the encoder decoded and cropped the source's samples (the same rules reproduce the same pixels)."""

    buckets: tuple[Size, ...]
    wrong_size: str
    max_pixels: int | None = None
    max_caption_chars: int | None = None


@dataclass(frozen=True)
class Wanted:
    """Where a latent sits (bucket file, row) and the crop its manifest row records."""

    bucket: Size
    row: int
    crop: tuple[int, int, int, int]


@dataclass
class ShardConditions:
    """One latent shard's conditions: per bucket, the packed maps and validity; the skipped samples."""

    maps: dict[Size, np.ndarray]
    valid: dict[Size, np.ndarray]
    skipped: dict[str, str] = field(default_factory=dict)
    """Key → why it has no condition: ``<reason>: <detail>``, the reason one of :data:`SKIP_REASONS`."""

    @property
    def made(self) -> int:
        return int(sum(int(v.sum()) for v in self.valid.values()))


def settings_fingerprint(kind: str, settings: dict, rules: DecodeRules) -> str:
    """sha256 of what changes a condition's pixels besides its latent part: format, kind, settings, decoding, OpenCV."""
    parts = [FORMAT, kind, settings, rules.wrong_size, rules.max_pixels, cv2.__version__]
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def wanted_samples(part: pa.Table) -> dict[str, Wanted]:
    """Each manifest row's key → its bucket file, row and crop box."""
    cols = part.select(["key", "bucket_width", "bucket_height", "row", "crop_left", "crop_top", "crop_right",
                        "crop_bottom"]).to_pydict()  # fmt: skip
    return {
        key: Wanted((bw, bh), row, (cl, ct, cr, cb))
        for key, bw, bh, row, cl, ct, cr, cb in zip(*cols.values(), strict=True)
    }


def condition_shard(
    tar_path: str, part: pa.Table, rules: DecodeRules, settings: dict, pool: ThreadPoolExecutor
) -> ShardConditions:
    """The Canny conditions of every sample ``part`` (a latent shard's manifest rows) lists, from its input tar."""
    wanted = wanted_samples(part)
    sizes = Counter(w.bucket for w in wanted.values())
    out = ShardConditions(
        maps={b: np.zeros((n, (b[0] * b[1] + 7) // 8), np.uint8) for b, n in sizes.items()},
        valid={b: np.zeros(n, np.uint8) for b, n in sizes.items()},
    )
    seen: set[str] = set()
    edges_of = partial(_edges_of, rules=rules, settings=settings)
    for results in _bounded_map(pool, edges_of, _chunks(tar_path, wanted, rules)):
        for decoded, packed in results:
            seen.add(decoded.key)
            _place(out, wanted[decoded.key], decoded, packed)
    for key in wanted.keys() - seen:
        out.skipped[key] = "missing: not in the input tar (or after damage in it)"
    return out


def _bounded_map(pool: ThreadPoolExecutor, fn, items: Iterator, ahead: int = 4) -> Iterator:
    """``fn`` over ``items`` on ``pool``, at most ``ahead`` jobs in flight (a tar is never held in memory whole)."""
    pending = deque()
    for item in items:
        pending.append(pool.submit(fn, item))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _chunks(tar_path: str, wanted: dict[str, Wanted], rules: DecodeRules) -> Iterator[list]:
    """The tar's samples that have a latent, in chunks of :data:`CHUNK`."""
    chunk, counts = [], Counter()
    with open(tar_path, "rb", buffering=1 << 20) as fh:
        for key, files in iter_tar_groups(fh, counts, rules.max_caption_chars, rules.max_pixels):
            if key in wanted:
                chunk.append((key, files))
                if len(chunk) == CHUNK:
                    yield chunk
                    chunk = []
    if chunk:
        yield chunk


def _edges_of(chunk: list, rules: DecodeRules, settings: dict) -> list[tuple[Decoded, np.ndarray | None]]:
    """Decode and crop each sample as the encoder does, then its packed Canny map (None when it did not decode)."""
    out = []
    for key, files in chunk:
        d = decode_sample(key, files, rules.buckets, rules.wrong_size, rules.max_pixels, rules.max_caption_chars)
        edges = None if d.image is None else pack_edges(canny_edges(d.image, **settings))
        d.image = None  # only the packed map is kept
        out.append((d, edges))
    return out


def _place(out: ShardConditions, want: Wanted, decoded: Decoded, packed: np.ndarray | None) -> None:
    """Put a sample's map at its latent's row, or record why it has none."""
    if packed is None:
        out.skipped[decoded.key] = f"undecodable: {decoded.problem}"
    elif decoded.bucket != want.bucket or decoded.crop != want.crop:
        out.skipped[decoded.key] = (f"crop_mismatch: decodes to bucket {decoded.bucket} crop {decoded.crop}, its "
                                    f"latent has bucket {want.bucket} crop {want.crop}")  # fmt: skip
    else:
        out.maps[want.bucket][want.row] = packed
        out.valid[want.bucket][want.row] = 1


def marker_name(shard: int) -> str:
    return f"shard-{shard:05d}.json"


def write_shard(out_dir: Path, shard: int, kind: str, got: ShardConditions, stamp: dict) -> None:
    """Write one shard's bucket files, then its marker (the shard is done); older files of the shard go first."""
    (out_dir / marker_name(shard)).unlink(missing_ok=True)
    for old in out_dir.glob(f"shard-{shard:05d}-*.safetensors"):
        old.unlink()
    files = {}
    for (w, h), maps in got.maps.items():
        name = store.shard_name(shard, (w, h))
        meta = {"format": FORMAT, "kind": kind, "width": str(w), "height": str(h), **stamp}
        atomic_write_bytes(out_dir / name, save({kind: maps, "valid": got.valid[(w, h)]}, metadata=meta))
        files[name] = len(maps)
    write_json(out_dir / marker_name(shard), {**stamp, "files": files, "conditions": got.made, "skipped": got.skipped})


def done_marker(out_dir: Path, shard: int, stamp: dict) -> dict | None:
    """The shard's marker when it is complete and made from ``stamp`` (the same latent part and settings), else
    None (redo it)."""
    path = out_dir / marker_name(shard)
    try:
        marker = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if any(marker.get(k) != v for k, v in stamp.items()):
        return None
    if not all((out_dir / name).is_file() for name in marker.get("files", {})):
        return None
    return marker


def remove_stale(out_dir: Path, keep: set[int]) -> int:
    """Remove temp files of a killed run and the files of shards whose latent shard is gone; how many files."""
    removed = 0
    for path in sorted(p for p in out_dir.iterdir() if p.is_file()):
        number = store.shard_number(path.name)  # None for a temp file (".shard-….tmp")
        if number is None or number not in keep:
            log.warning("%s: no latent shard for it any more (or a killed write's temp file); removed", path)
            path.unlink(missing_ok=True)
            removed += 1
    return removed
