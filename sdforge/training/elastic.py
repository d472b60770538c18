"""A run's global batch, and how it is cut over the ranks of the job that trains it (elastic resume).

A phase's global batch (samples per optimizer step) is fixed when the run starts: ``batch_size ×
grad_accum × world``. A run resumed on another world size keeps it — the epoch's plan of global batches
depends on it and on (seed, epoch) only, so the resumed job trains exactly the samples not yet trained
on — and cuts it anew with :func:`choose_split`. docs/RESILIENCE.md says what is guaranteed.
"""

from __future__ import annotations

import logging

from sdforge.io import InputError
from sdforge.latents.bucket_batches import BatchSplit

log = logging.getLogger(__name__)


class SplitError(InputError):
    """The run's global batch cannot be cut evenly over this job's ranks."""


def choose_split(global_batch: int, micro: int, world: int, phase: str) -> BatchSplit:
    """Cut ``global_batch`` over ``world`` ranks: the largest micro-batch ≤ ``micro`` (``phases.<p>.batch_size``:
    never more memory per rank than configured) that divides the per-rank share, the rest as accumulation.

    A :class:`SplitError` naming the numbers and the keys to change when ``world`` does not divide it.
    """
    if global_batch % world:
        fits = [w for w in range(1, min(global_batch, 64) + 1) if global_batch % w == 0]
        raise SplitError(
            f"train@{phase}: this run's global batch is {global_batch} samples per optimizer step, which "
            f"{world} ranks cannot share evenly ({global_batch} is not a multiple of {world}). Resume it on a "
            f"world size that divides {global_batch} ({', '.join(map(str, fits))}: train.nproc_per_node × "
            f"train.nnodes), or start the phase over with a new global batch: set phases.{phase}.batch_size × "
            f"phases.{phase}.grad_accum × ranks to it and delete the phase's run dir (paths.runs/{phase})."
        )
    per_rank = global_batch // world
    size = max(d for d in range(1, min(micro, per_rank) + 1) if per_rank % d == 0)
    split = BatchSplit(micro=size, accum=per_rank // size, world=world)
    if size < min(micro, per_rank):
        log.warning(
            "train@%s: global batch %d over %d ranks: micro-batch %d × %d accumulation per rank "
            "(phases.%s.batch_size %d does not divide the %d samples per rank)",
            phase, global_batch, world, split.micro, split.accum, phase, micro, per_rank,
        )
    return split
