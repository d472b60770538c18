"""Which caption a sample trains with: original or synthetic, per (seed, sample key, epoch).

A pure function of its arguments — no generator state — so a resumed run, a run on another number of ranks and an
uninterrupted one make the same choice for every sample of every epoch. The share of synthetic captions is
``p_synthetic`` in expectation; :func:`realised_share` is what a phase logs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

SCALE = float(2**64)


def uses_synthetic(seed: int, key: str, epoch: int, p_synthetic: float) -> bool:
    """True if sample ``key`` trains with its synthetic caption in ``epoch`` (probability ``p_synthetic``)."""
    if p_synthetic <= 0.0:
        return False
    if p_synthetic >= 1.0:
        return True
    digest = hashlib.blake2b(f"{seed}:{epoch}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / SCALE < p_synthetic


def realised_share(seed: int, keys: Iterable[str], epoch: int, p_synthetic: float) -> float:
    """The share of ``keys`` that train with their synthetic caption in ``epoch``."""
    keys = list(keys)
    return sum(uses_synthetic(seed, k, epoch, p_synthetic) for k in keys) / max(len(keys), 1)
