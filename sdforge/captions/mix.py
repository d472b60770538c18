"""Which caption a sample trains with: original or synthetic, per (seed, sample, epoch).

A pure function of its arguments — no generator state — so a resumed run, a run on another number of ranks and an
uninterrupted one make the same choice for every sample of every epoch. A sample is named by where its latents
live (source name, shard, bucket, row: :func:`sample_ids`), never by its position in a phase index, so the same
sample gets the same draw in every phase index that holds it. The draw is a splitmix64 hash, vectorised over a
whole phase (millions of samples per epoch in well under a second). The share of synthetic captions is
``p_synthetic`` in expectation; :func:`realised_share` is what a phase logs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, element-wise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def name_hash(name: str) -> int:
    """A stable 64-bit hash of a name (blake2b; Python's ``hash`` changes per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")


def sample_ids(sources: Sequence[str], source_code, shard, bucket_width, bucket_height, row) -> np.ndarray:
    """One uint64 per sample from (source name, shard, bucket, row in the bucket's file)."""
    names = np.asarray([name_hash(s) for s in sources], dtype=np.uint64)
    h = splitmix64(names[np.asarray(source_code)] ^ np.asarray(shard, dtype=np.uint64))
    bucket = (np.asarray(bucket_width, dtype=np.uint64) << np.uint64(32)) | np.asarray(bucket_height, dtype=np.uint64)
    h = splitmix64(h ^ bucket)
    return splitmix64(h ^ np.asarray(row, dtype=np.uint64))


def synthetic_mask(seed: int, epoch: int, ids: np.ndarray, p_synthetic: float) -> np.ndarray:
    """True where sample ``ids[i]`` trains with its synthetic caption in ``epoch`` (probability ``p_synthetic``)."""
    ids = np.asarray(ids, dtype=np.uint64)
    if p_synthetic <= 0.0:
        return np.zeros(ids.shape, dtype=bool)
    if p_synthetic >= 1.0:
        return np.ones(ids.shape, dtype=bool)
    salt = splitmix64(np.asarray([name_hash(f"caption-mix:{seed}:{epoch}")], dtype=np.uint64))
    draw = splitmix64(ids ^ salt) >> np.uint64(11)  # 53 bits: exact in a float64
    return draw.astype(np.float64) / float(2**53) < p_synthetic


def realised_share(seed: int, ids: np.ndarray, epoch: int, p_synthetic: float) -> float:
    """The share of ``ids`` that train with their synthetic caption in ``epoch``."""
    mask = synthetic_mask(seed, epoch, ids, p_synthetic)
    return float(mask.mean()) if mask.size else 0.0
