"""Stopping on a preemption notice: SIGTERM marks the process, the ranks agree at the next step boundary.

Kubernetes sends SIGTERM and waits ``terminationGracePeriodSeconds`` (30 s by default) before SIGKILL; spot
and preemptible VMs give 30 s to 2 min of notice. :class:`PreemptionNotice` only records the signal (a
handler must not do work); after each optimizer step :func:`agree` runs one all-reduce that carries, for
every rank, whether it was signalled and how long ago, rank 0's estimate of a checkpoint write, and the
step's per-source loss sums (so per-source curves cost no collective of their own). Every rank reaches the
same decision from the same reduced numbers: stop, and write a checkpoint only if
``elapsed + estimated write ≤ train.preempt_grace_s`` — a write that cannot finish would be cut by SIGKILL
(never torn: checkpoints are renamed into place when complete, but it would be time lost), so the last
good checkpoint is kept instead and the log says so.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class Preempted(Exception):
    """Training stopped on SIGTERM at a step boundary; ``checkpoint`` is the one written (None: kept the last)."""

    def __init__(self, step: int, checkpoint, elapsed_s: float):
        self.step, self.checkpoint, self.elapsed_s = step, checkpoint, elapsed_s
        where = f"checkpoint {checkpoint.name}" if checkpoint else "no new checkpoint (the last good one is kept)"
        super().__init__(f"preempted at step {step}: {where}, {elapsed_s:.1f} s after SIGTERM")

    def record(self) -> dict:
        """What ``runs/<phase>/PREEMPTED.json`` says."""
        checkpoint = str(self.checkpoint) if self.checkpoint else None
        return {"step": self.step, "checkpoint": checkpoint, "after_sigterm_s": round(self.elapsed_s, 2)}


class PreemptionNotice:
    """Records SIGTERM (time of the first one) while installed; :meth:`close` restores the previous handler."""

    def __init__(self):
        self.received: float | None = None
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, _frame) -> None:
        if self.received is None:
            self.received = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the first SIGTERM (0 when none)."""
        return 0.0 if self.received is None else time.monotonic() - self.received

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


@dataclass(frozen=True)
class StepAgreement:
    """What every rank knows after a step's all-reduce."""

    source_loss_sum: list[float]
    source_count: list[int]
    stop: bool
    save: bool
    elapsed_s: float
    """Mean seconds since SIGTERM over the signalled ranks."""


def agree(
    dist, losses: torch.Tensor, codes: torch.Tensor, n_sources: int, notice: PreemptionNotice | None,
    write_estimate_s: float, grace_s: float,
) -> StepAgreement:
    """One all-reduce (none on one process): per-source loss sums and counts of the step's samples (this
    rank's ``losses`` with source ``codes``), the preemption flags, rank 0's write estimate; the decision."""
    signalled = notice is not None and notice.received is not None
    row = torch.zeros(2 * n_sources + 3, dtype=torch.float64)
    row[:n_sources].index_add_(0, codes.long(), losses.double())
    row[n_sources : 2 * n_sources].index_add_(0, codes.long(), torch.ones_like(losses, dtype=torch.float64))
    row[-3] = float(signalled)
    row[-2] = notice.elapsed() if signalled else 0.0
    row[-1] = write_estimate_s if dist.is_main else 0.0
    if dist.world > 1:
        row = row.to(dist.device)
        torch.distributed.all_reduce(row)
        row = row.cpu()
    flags, elapsed_sum, estimate = float(row[-3]), float(row[-2]), float(row[-1])
    elapsed = elapsed_sum / flags if flags else 0.0
    stop = flags > 0
    save = stop and elapsed + estimate <= grace_s
    if stop and not save:
        log.warning(
            "preempted %.1f s after SIGTERM: a checkpoint write (~%.1f s measured) would end past "
            "train.preempt_grace_s = %g s; keeping the last good checkpoint instead of risking a cut write",
            elapsed, estimate, grace_s,
        )
    counts = [int(c) for c in row[n_sources : 2 * n_sources].tolist()]
    return StepAgreement(row[:n_sources].tolist(), counts, stop, save, elapsed)
