"""Batches by aspect-ratio bucket: every batch holds samples of one shape (issue 18's loader order; no I/O).

An epoch's plan is a list of *global* batches: the samples of one optimizer step, ``global_batch`` sample
positions each, all from one bucket. How a global batch is cut over ranks and accumulation micro-steps is a
:class:`BatchSplit` (per-rank micro-batch × accumulation × world = global batch): micro-step ``k`` of rank
``r`` takes positions ``[(k·world + r)·micro, (k·world + r + 1)·micro)``, so at every step all ranks train
on the same shape and their samples are disjoint. The plan is a pure function of (bucket of each sample,
epoch, seed, global batch, tail mode) — never of the world size: every rank computes the same one, a run
resumed at step ``k`` of the epoch starts at ``plan[k]`` without reading the batches before it, and a run
resumed on another number of ranks (with the same global batch) trains on exactly the samples not yet
trained on (docs/ELASTIC.md).

Per bucket, the samples are shuffled with a seed of (seed, epoch, bucket) and cut into global batches; the
batches of all buckets are then shuffled together with a seed of (seed, epoch). A bucket's tail smaller
than a global batch is either dropped (``tail="drop"``) or carried (``tail="carry"``): the samples left out
of epoch ``e`` go first in their bucket in epoch ``e + 1`` (each sample still appears at most once per
epoch, and none is left out two epochs in a row).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

TAIL_MODES = ("drop", "carry")


@dataclass(frozen=True)
class BatchSplit:
    """How one global batch is cut: ``world`` ranks × ``accum`` micro-steps × ``micro`` samples."""

    micro: int
    accum: int
    world: int

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.world

    def part(self, k: int, rank: int) -> slice:
        """The positions in a global batch of rank ``rank``'s micro-step ``k``."""
        start = (k * self.world + rank) * self.micro
        return slice(start, start + self.micro)


@dataclass
class EpochPlan:
    """One epoch's global batches (arrays of sample positions), the bucket of each, and what was left out."""

    batches: list[np.ndarray]
    buckets: list[int]
    left_out: dict[int, np.ndarray] = field(default_factory=dict)
    """Bucket → its tail this epoch (carried to the next epoch, or dropped)."""

    def micro_batches(self, rank: int, split: BatchSplit) -> list[np.ndarray]:
        """Rank ``rank``'s micro-batches of the epoch, step by step (``split.accum`` per global batch)."""
        return [batch[split.part(k, rank)] for batch in self.batches for k in range(split.accum)]

    def counts(self) -> dict[str, int]:
        """Samples trained per bucket (``samples.bucket<i>``) and left out (``left_out.bucket<i>``)."""
        out: dict[str, int] = {}
        for bucket, batch in zip(self.buckets, self.batches, strict=True):
            out[f"samples.bucket{bucket}"] = out.get(f"samples.bucket{bucket}", 0) + len(batch)
        out.update({f"left_out.bucket{b}": len(tail) for b, tail in sorted(self.left_out.items())})
        return out


def plan_epoch(sample_buckets: np.ndarray, epoch: int, seed: int, global_batch: int, tail: str = "drop") -> EpochPlan:
    """The global batches of ``epoch`` for samples whose bucket ids are ``sample_buckets`` (position i: sample i)."""
    if tail not in TAIL_MODES:
        raise ValueError(f"tail must be one of {TAIL_MODES}, got {tail!r}")
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    sample_buckets = np.asarray(sample_buckets)
    if sample_buckets.size and (sample_buckets.dtype.kind not in "iu" or sample_buckets.min() < 0):
        raise ValueError(f"bucket ids must be integers >= 0, got dtype {sample_buckets.dtype}")
    carried: dict[int, np.ndarray] = {}
    if tail == "carry":  # the tails of every earlier epoch, in order (cheap: permutations only)
        for earlier in range(epoch):
            carried = _cut(sample_buckets, earlier, seed, global_batch, carried).left_out
    return _cut(sample_buckets, epoch, seed, global_batch, carried)


def plan_epochs(
    sample_buckets: np.ndarray, epochs: int, seed: int, global_batch: int, tail: str = "drop"
) -> Iterator[EpochPlan]:
    """:func:`plan_epoch` for epochs ``0 .. epochs-1`` in one pass (each epoch's carried tails come from the
    previous plan: linear in ``epochs``, where calling :func:`plan_epoch` per epoch replays every earlier one)."""
    carried: dict[int, np.ndarray] = {}
    for epoch in range(epochs):
        plan = plan_epoch(sample_buckets, 0, seed, global_batch, tail) if epoch == 0 else None  # validates
        if plan is None:
            plan = _cut(np.asarray(sample_buckets), epoch, seed, global_batch, carried)
        carried = plan.left_out if tail == "carry" else {}
        yield plan


def _cut(sample_buckets: np.ndarray, epoch: int, seed: int, global_batch: int, carried: dict[int, np.ndarray]):
    batches, buckets, left_out = [], [], {}
    for bucket in np.unique(sample_buckets).tolist():
        members = np.flatnonzero(sample_buckets == bucket)
        order = np.random.default_rng([seed, epoch, bucket]).permutation(members)
        first = carried.get(bucket)
        if first is not None and first.size:
            order = np.concatenate([first, order[~np.isin(order, first)]])
        full = len(order) // global_batch * global_batch
        batches += list(order[:full].reshape(-1, global_batch))
        buckets += [bucket] * (full // global_batch)
        left_out[bucket] = order[full:]
    shuffle = np.random.default_rng([seed, epoch]).permutation(len(batches))
    return EpochPlan([batches[i] for i in shuffle], [buckets[i] for i in shuffle], left_out)
