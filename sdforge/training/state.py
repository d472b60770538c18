"""Where a run is: the plan of its optimizer steps at the run's global batch (:class:`Plan`), and the state that
advances with them (:class:`TrainState`: progress, the shared sample generator, the loss history, the sample
ledger) — a stateful component of every checkpoint.

The data order is a pure function of (seed, epoch, global batch), cut over the ranks by a
:class:`~sdforge.latents.bucket_batches.BatchSplit`; a run resumed on another world size keeps its global batch
(:mod:`sdforge.training.elastic`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sdforge.config import Phase, Train
from sdforge.latents.bucket_batches import BatchSplit, plan_epoch, plan_epochs
from sdforge.latents.loader import LatentIndexDataset, epochs_summary, rank_batches
from sdforge.training.checkpoints import Progress
from sdforge.training.elastic import choose_split
from sdforge.training.ledger import LedgerBuffer

LOSS_TAIL = 20
"""Step losses kept in each checkpoint (mean over ranks) so a resumed run reports the same ``final_loss``."""


@dataclass(frozen=True)
class Plan:
    """The phase's optimizer steps at one global batch: this job's split of it, steps per epoch, bucket counts."""

    split: BatchSplit
    epoch_lengths: list[int]
    bucket_counts: dict
    epochs: int
    seed: int
    tail: str

    @classmethod
    def build(cls, data: LatentIndexDataset, phase: Phase, phase_name: str, cfg: Train, world: int, global_batch: int,
              micro: int | None = None):  # fmt: skip
        """The plan for ``global_batch`` samples per step (a SplitError if ``world`` ranks cannot share it), with
        micro-batches of at most ``micro`` (default ``phases.<p>.batch_size``; a memory plan's may be smaller)."""
        split = choose_split(global_batch, micro or phase.batch_size, world, phase_name)
        lengths, counts = epochs_summary(data, phase.epochs, cfg.seed, global_batch, cfg.bucket_tail)
        return cls(split, lengths, counts, phase.epochs, cfg.seed, cfg.bucket_tail)

    @property
    def global_batch(self) -> int:
        return self.split.global_batch

    @property
    def total_steps(self) -> int:
        return sum(self.epoch_lengths)

    def rank_batches(self, data: LatentIndexDataset, epoch: int, rank: int) -> list:
        """This rank's micro-batches (sample positions) of ``epoch``: :func:`sdforge.latents.loader.rank_batches`."""
        return rank_batches(data.sample_bucket, epoch, self.seed, rank, self.split, self.tail)

    def epoch_plan(self, data: LatentIndexDataset, epoch: int):
        """The global batches of ``epoch`` (every rank's): :func:`sdforge.latents.bucket_batches.plan_epoch`."""
        return plan_epoch(data.sample_bucket, epoch, self.seed, self.global_batch, self.tail)

    def all_epochs(self, data: LatentIndexDataset) -> list:
        """The plan of every epoch of the phase."""
        return list(plan_epochs(data.sample_bucket, self.epochs, self.seed, self.global_batch, self.tail))


class TrainState:
    """Progress, the generator every rank holds alike (per-sample streams are split off it:
    :func:`sdforge.training.distributed.step_seeds`), the step losses, and the sample ledger of this rank."""

    def __init__(self, seed: int, rank: int):
        self.progress = Progress()
        self.generator = torch.Generator().manual_seed(seed * 1000)
        self.losses: list[float] = []
        """A resumed run's last :data:`LOSS_TAIL` losses before its checkpoint, then this run's."""
        self.ledger = LedgerBuffer(rank)
        self.ledger_segments: list[dict] = []
        """The ledger segments of the checkpoint resumed from, then of each one written."""

    def state_dict(self) -> dict:
        """The last :data:`LOSS_TAIL` losses (the checkpoint writes progress itself and lists the ledger segments
        in its manifest; the RNG goes to per-rank files)."""
        return {"recent_losses": self.losses[-LOSS_TAIL:]}

    def load_state_dict(self, state: dict) -> None:
        """Progress, loss tail and ledger segments from a loaded checkpoint state
        (:func:`sdforge.training.checkpoints.load_state`)."""
        self.progress = Progress(**state["progress"])
        self.losses = list(state.get("recent_losses", []))
        self.ledger_segments = list(state.get("ledger", []))
