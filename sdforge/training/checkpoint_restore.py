"""Restoring a job from a checkpoint (the save side: :mod:`sdforge.training.checkpoint_manager`): the newest one that
restores in full on every rank, its weights read into the run as it is laid out now (replicated or sharded, on any
world size), every component's state, and each rank's RNG."""

from __future__ import annotations

import logging
from pathlib import Path

from sdforge.training.checkpoints import STATE, CheckpointError, restore_rng, rng_path
from sdforge.training.distributed import derive_rank_rng
from sdforge.training.ledger import keep_only
from sdforge.training.resume import restore_newest
from sdforge.training.sharded_state import SHARDS_DIR, distribute_like, load_shards
from sdforge.training.trained_model import first_line

log = logging.getLogger(__name__)

COMPONENTS = ("optim", "state")
"""The job's stateful components saved in ``state.pt``: the optimization (optimizer, LR schedule, EMA) and the
train state (progress, loss tail). The plan contributes the run's global batch, restored first (it re-plans the
LR schedule that the optimization then loads)."""


class CheckpointRestore:
    """The restore half of :class:`~sdforge.training.checkpoint_manager.CheckpointManager` (its ``job``,
    ``run_dir``, ``remote``, ``mark`` and ``state_dict()``)."""

    def restore_newest(self) -> Path | None:
        """Restore the newest checkpoint that restores in full on every rank (local or remote); then keep only
        its ledger segments (main rank). Its path, or None on a fresh start."""
        dist = self.job.dist
        restored = restore_newest(self.run_dir, self.restore, rank=dist.rank, world=dist.world, remote=self.remote)
        if dist.is_main:
            keep_only(self.run_dir, self.job.state.ledger_segments)
        self.mark = len(self.job.state.losses)
        return restored

    def restore(self, ckpt: Path, state: dict) -> None:
        """Load live weights, every component's state and this rank's RNG (``state["rng"]``) from ``ckpt``.

        Any failure is a CheckpointError naming the file, so :func:`sdforge.training.resume.restore_newest` can
        fall back to an older checkpoint.
        """
        job = self.job
        global_batch = state.get("global_batch")
        if not isinstance(global_batch, int) or global_batch < 1:
            raise CheckpointError(f"{ckpt / STATE}: no global batch recorded (written by an older sdforge)")
        if global_batch != job.plan.global_batch:
            job.set_global_batch(global_batch)  # another world size: keep the run's global batch (and its schedule)
        state = self._read_weights(ckpt, state)  # after the plan: the state it reads into holds the LR schedule
        try:
            for name in COMPONENTS:
                getattr(job, name).load_state_dict(state)
        except Exception as err:
            why = f"{type(err).__name__}: {first_line(err)}"
            raise CheckpointError(f"{ckpt / STATE}: not this run's state ({why})") from err
        self._restore_rng(ckpt, state)
        p = job.state.progress
        log.info("resumed from %s at step %d (epoch %d, step %d of it)", ckpt, p.step, p.epoch, p.batch)

    def _read_weights(self, ckpt: Path, state: dict) -> dict:
        """The live weights into the model, and ``state`` ready for the components: a sharded checkpoint's tensors
        read into this run's (sharded or whole, at any world size), a replicated one's cut into this run's shards
        when it is sharded (:mod:`sdforge.training.sharded_state`)."""
        job = self.job
        if job.model.sharded or (ckpt / SHARDS_DIR).is_dir():
            job.optim.materialize()  # the optimizer's moments: tensors to read or cut into
        if not (ckpt / SHARDS_DIR).is_dir():
            job.model.load_live(ckpt)
            return distribute_like(state, self.state_dict()) if job.model.sharded else state
        try:
            return load_shards(state, self.state_dict(), job.model.live_tensors(), ckpt / SHARDS_DIR)
        except Exception as err:
            raise CheckpointError(f"{ckpt / SHARDS_DIR}: not this run's weights ({first_line(err)})") from err

    def _restore_rng(self, ckpt: Path, state: dict) -> None:
        job = self.job
        same_world = state.get("world", job.dist.world) == job.dist.world
        try:
            if same_world:
                restore_rng(state["rng"], job.state.generator, job.dist.device)
            else:
                job.state.generator.set_state(state["rng"]["generator"])
        except Exception as err:
            rng = rng_path(ckpt, job.dist.rank if same_world else 0)
            raise CheckpointError(f"{rng}: not an RNG state ({type(err).__name__}: {first_line(err)})") from err
        if not same_world:
            derive_rank_rng(job.cfg.seed, job.state.progress.step, job.dist.rank)
            split = job.plan.split
            log.warning(
                "resuming a checkpoint of %d rank(s) on %d: global batch %d kept (%d × %d accumulation per rank); "
                "each sample is trained exactly once, per-rank RNG re-derived from (seed, step, rank)",
                state["world"], job.dist.world, split.global_batch, split.micro, split.accum,
            )  # fmt: skip
