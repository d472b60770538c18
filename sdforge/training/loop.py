"""The training loop: epochs of optimizer steps, with hooks around each (:mod:`sdforge.training.hooks`).

Each optimizer step trains one global batch of the epoch's plan (:func:`~sdforge.training.step.train_step`);
everything else — the ledger, the per-step agreement and preemption, the watchdog, reports, validation,
checkpoints, fault injection — is a hook with its own schedule.
"""

from __future__ import annotations

from sdforge.training.hooks import Hooks
from sdforge.training.step import EpochReader, train_step


def train_loop(job, hooks: Hooks, step=train_step, reader=EpochReader) -> None:
    """Run ``job``'s remaining epochs from its progress (mid-epoch after a resume); hooks see every event.

    ``step(job, reader)`` trains one optimizer step and advances ``job.state.progress``; ``reader(job, epoch)``
    gives the epoch's batches and its number of ``steps`` (the defaults: the real ones; tests pass toys).
    """
    progress = job.state.progress
    hooks.start(job)
    while progress.epoch < job.plan.epochs:
        batches = reader(job, progress.epoch)
        while progress.batch < batches.steps:
            hooks.before_step(job)
            report = step(job, batches)
            hooks.after_step(job, report)
        progress.epoch, progress.batch = progress.epoch + 1, 0
        hooks.epoch_end(job)
    hooks.end(job)
