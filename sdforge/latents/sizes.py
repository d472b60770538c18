"""Each training sample's size and crop, read beside its latent: SDXL's micro-conditioning (``time_ids``).

``encode_latents`` decides every image's bucket and crop and records them in the latent store's manifest parts
(``shard-NNNNN.parquet``: ``width``/``height`` as found in the tar, ``original_width``/``original_height`` from the
metadata when known, the crop box in the resized image, the bucket). For a family that takes them
(:attr:`model.denoisers.base.DenoiserFamily.micro_conditioning`) the trainer reads, per sample, SDXL's six
numbers in pixels:

=====================  =====================================================================================
original (h, w)        ``original_height/width`` (the image before any download resize); the size found in the
                       tar where the metadata has none
crop top-left          ``(crop_top, crop_left)``: where the bucket's window sits in the image resized to cover it
target (h, w)          the bucket's ``(height, width)``
=====================  =====================================================================================

The parts are read once, when the reader opens; a part whose rows do not cover its latent files is an InputError
naming it (the store was written by another encode: re-run ``encode_latents``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sdforge.io import InputError
from sdforge.latents import store
from sdforge.latents.loader import LatentIndexDataset

SIZE_COLUMNS = ("row", "bucket_width", "bucket_height", "width", "height", "original_width", "original_height",
                "crop_left", "crop_top")  # fmt: skip


class SizeReader:
    """The micro-conditioning sizes of the samples of ``data`` (one phase's index), from its latent manifest parts."""

    def __init__(self, data: LatentIndexDataset, latents_dir: Path, resolution: str):
        self.data = data
        parts: dict[tuple[str, int], pa.Table] = {}
        self.files: list[np.ndarray] = []
        known: list[np.ndarray] = []
        for sid, (source, shard, bucket) in enumerate(data.shard_keys):
            part = store.resolution_dir(Path(latents_dir), source, resolution) / store.part_name(shard)
            if (source, shard) not in parts:
                parts[(source, shard)] = _read_sizes(part)
            sizes, original = _bucket_sizes(parts[(source, shard)], bucket, part, data.file_rows(sid))
            self.files.append(sizes)
            known.append(original)
        sids, rows = data.locate(np.arange(len(data)))
        self.original_known = int(sum(known[s][r] for s, r in zip(sids.tolist(), rows.tolist(), strict=True)))
        """How many of the index's samples have their original size from the metadata (the others: as fetched)."""

    def metrics(self) -> dict[str, int]:
        """``micro_conditioning.samples`` and ``.original_known``: the share conditioned on a true original size."""
        return {"micro_conditioning.samples": len(self.data), "micro_conditioning.original_known": self.original_known}

    def gather(self, positions: np.ndarray) -> torch.Tensor:
        """``float32 [B, 6]``: original h, w, crop top, left, target h, w of the samples at index ``positions``."""
        sids, rows = self.data.locate(positions)
        return torch.from_numpy(np.stack([self.files[s][r] for s, r in zip(sids.tolist(), rows.tolist(), strict=True)]))


def size_reader(needs_sizes: bool, data: LatentIndexDataset, latents_dir: Path, resolution: str) -> SizeReader | None:
    """A :class:`SizeReader` for a family that takes micro-conditioning (``needs_sizes``), else None."""
    return SizeReader(data, latents_dir, resolution) if needs_sizes else None


def _read_sizes(path: Path) -> pa.Table:
    """The size columns of one manifest part; an InputError naming it when it cannot give them."""
    remedy = "re-run encode_latents for this source"
    try:
        table = pq.read_table(path, columns=list(SIZE_COLUMNS))
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"{path}: cannot read its size columns ({type(err).__name__}: {err}); {remedy}") from None
    nulls = [c for c in SIZE_COLUMNS if not c.startswith("original_") and table[c].null_count]
    if nulls:
        raise InputError(f"{path}: null values in column(s) {nulls}; {remedy}")
    return table


def _bucket_sizes(table: pa.Table, bucket: tuple[int, int], path: Path, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``float32 [rows, 6]`` of ``bucket``'s samples in part ``table`` (whose latent file holds ``count``), in their
    latent-file row order, and whether each one's original size was known."""
    col = {c: table[c].to_numpy(zero_copy_only=False) for c in SIZE_COLUMNS}
    mine = (col["bucket_width"] == bucket[0]) & (col["bucket_height"] == bucket[1])
    rows = col["row"][mine].astype(np.int64)
    if not np.array_equal(np.sort(rows), np.arange(count)):
        raise InputError(f"{path}: bucket {bucket[0]}x{bucket[1]}'s rows are not its latent file's 0..{count - 1}; "
                         "re-run encode_latents for this source")  # fmt: skip
    known = _positive(col["original_height"][mine]) & _positive(col["original_width"][mine])
    height = np.where(known, col["original_height"][mine], col["height"][mine])
    width = np.where(known, col["original_width"][mine], col["width"][mine])
    sizes = np.stack([height, width, col["crop_top"][mine], col["crop_left"][mine],
                      np.full(len(rows), bucket[1]), np.full(len(rows), bucket[0])], axis=1)  # fmt: skip
    out, original = np.empty(sizes.shape, dtype=np.float32), np.empty(len(rows), dtype=bool)
    out[rows], original[rows] = sizes, known
    return out, original


def _positive(values: np.ndarray) -> np.ndarray:
    """Where a nullable size column holds a size (not null, > 0)."""
    values = np.asarray(values, dtype=np.float64)  # nulls read as NaN
    return np.isfinite(values) & (values > 0)
