"""Everything around the step, as hooks with their own schedules: the sample ledger, the per-step agreement
(per-source losses, preemption), checkpoints, fault injection — and, elsewhere, the hang watchdog
(:mod:`~sdforge.training.watchdog`), validation images (:mod:`~sdforge.training.validation`), the step record and
MLflow (:mod:`~sdforge.training.reporting`).

A hook overrides the events it needs (:class:`Hook`); :class:`Hooks` calls them in list order — the order is
the protocol: the agreement before the reports that show its per-source losses, the reports before a
checkpoint (a preempted step is logged before the run stops), fault injection last (after the step's
checkpoint). ``close(error)`` always runs, in reverse order, with the exception that ended the run (None when
it finished), so each hook can say how the run ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time

import torch

from sdforge.training.exits import PREEMPTED, write_marker
from sdforge.training.preemption import Preempted, PreemptionNotice, agree

log = logging.getLogger(__name__)


class Hook:
    """A no-op for every event; subclasses override what they need."""

    def start(self, job) -> None:
        """Before the first step (after the restore)."""

    def before_step(self, job) -> None:
        """Before an optimizer step's first micro-batch is read."""

    def busy_after(self, step: int) -> bool:
        """Whether this hook works long after optimizer step ``step`` on some rank (the others wait)."""
        return False

    def after_step(self, job, report) -> None:
        """After an optimizer step (:class:`~sdforge.training.step.StepReport`)."""

    def epoch_end(self, job) -> None:
        """After the last step of an epoch (progress already points at the next one)."""

    def end(self, job) -> None:
        """The last step is done (before the export)."""

    def finish(self, job, metrics: dict) -> None:
        """The phase is exported; its metrics (main rank: with the ledger's figures)."""

    def close(self, error: BaseException | None) -> None:
        """Always, last: ``error`` is what ended the run early (None: it finished)."""


class Hooks:
    """Calls every hook's events in order; :meth:`running` closes them whatever happens."""

    def __init__(self, hooks: list[Hook]):
        self.hooks = [h for h in hooks if h is not None]

    def _each(self, event: str, *args) -> None:
        for hook in self.hooks:
            getattr(hook, event)(*args)

    def start(self, job) -> None:
        self._each("start", job)

    def before_step(self, job) -> None:
        self._each("before_step", job)

    def after_step(self, job, report) -> None:
        report.busy = any(hook.busy_after(report.step) for hook in self.hooks)
        self._each("after_step", job, report)

    def epoch_end(self, job) -> None:
        self._each("epoch_end", job)

    def end(self, job) -> None:
        self._each("end", job)

    def finish(self, job, metrics: dict) -> None:
        self._each("finish", job, metrics)

    @contextlib.contextmanager
    def running(self):
        """Close every hook on the way out (reverse order), telling each why the run ended."""
        error = None
        try:
            yield self
        except BaseException as err:
            error = err
            raise
        finally:
            for hook in reversed(self.hooks):
                try:
                    hook.close(error)
                except Exception:  # noqa: BLE001 - one hook's failure to close must not hide the run's error
                    log.exception("closing %s failed", type(hook).__name__)


class LedgerHook(Hook):
    """Records every sample of every step (index position, loss, caption choice) in this rank's ledger buffer;
    the checkpoint manager writes the buffer as a segment (:mod:`sdforge.training.ledger`)."""

    def after_step(self, job, report) -> None:
        for k, (positions, losses) in enumerate(report.micro):
            job.state.ledger.record(report.step, report.epoch, k, positions, losses.numpy(), report.captions)


class PreemptionHook(Hook):
    """The step's one all-reduce (:func:`sdforge.training.preemption.agree`): per-source loss sums and counts of
    every rank, and whether a SIGTERM stops the run here — with a checkpoint if it fits in
    ``train.preempt_grace_s`` (the :class:`CheckpointHook` acts on it). Writes ``PREEMPTED.json`` when it does."""

    def __init__(self, notice: PreemptionNotice, manager, grace_s: float, run_dir):
        self.notice, self.manager, self.grace_s, self.run_dir = notice, manager, grace_s, run_dir
        self.is_main = False

    def start(self, job) -> None:
        self.is_main = job.dist.is_main

    def after_step(self, job, report) -> None:
        codes = torch.from_numpy(job.data.source_code[report.positions])
        report.agreed = agree(job.dist, report.per_sample, codes, len(job.data.sources), self.notice,
                              self.manager.write_estimate(), self.grace_s)  # fmt: skip

    def close(self, error: BaseException | None) -> None:
        if isinstance(error, Preempted) and self.is_main:
            write_marker(self.run_dir, PREEMPTED, error.record())


class CheckpointHook(Hook):
    """Checkpoints on schedule: every ``train.save_steps`` steps within an epoch, at every epoch end, and at a
    preemption stop (then the run ends with :class:`Preempted`); waits for the write in flight and pending
    uploads at the end."""

    def __init__(self, manager):
        self.manager = manager

    def after_step(self, job, report) -> None:
        agreed = report.agreed
        if agreed is not None and agreed.stop:  # the write in flight finishes; a new one only if it fits the grace
            path = self.manager.save(wait=True) if agreed.save else self.manager.finish_writes()
            self.manager.close()
            raise Preempted(report.step, path if agreed.save else None, agreed.elapsed_s)
        p, every = job.state.progress, job.cfg.save_steps
        if every and p.step % every == 0 and p.batch < job.plan.epoch_lengths[p.epoch]:
            self.manager.save()

    def epoch_end(self, job) -> None:
        self.manager.save()

    def end(self, job) -> None:
        self.manager.finish_writes()
        self.manager.close()

    def close(self, error: BaseException | None) -> None:
        self.manager.close()


class FaultInjectionHook(Hook):
    """Fault injection for the resume, preemption and hang tests, after the step's checkpoint:
    ``SDFORGE_KILL_AT_STEP=N`` SIGKILLs this process after step N once its checkpoint writes are done (so a test
    knows the resume point), ``SDFORGE_KILL_IN_WRITE_AT_STEP=N`` right away (inside a background write),
    ``SDFORGE_TERM_AT_STEP=N`` sends it SIGTERM (a preemption notice), ``SDFORGE_HANG_AT_STEP=N`` (with
    ``SDFORGE_HANG_RANK=r``: on rank r only) stops it for ever, as a stuck data read or a dead peer would."""

    def __init__(self, manager=None):
        self.manager = manager

    def after_step(self, job, report) -> None:
        if os.environ.get("SDFORGE_KILL_AT_STEP") == str(report.step) and self.manager is not None:
            self.manager.finish_writes()  # every rank: a rank that died first would take the main rank's write along
        _kill_point(report.step)
        _hang_point(report.step, job.dist.rank)


def _kill_point(step: int) -> None:
    if str(step) in (os.environ.get("SDFORGE_KILL_AT_STEP"), os.environ.get("SDFORGE_KILL_IN_WRITE_AT_STEP")):
        log.warning("SDFORGE_KILL_AT_STEP=%d: killing this process (fault injection)", step)
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get("SDFORGE_TERM_AT_STEP") == str(step):
        log.warning("SDFORGE_TERM_AT_STEP=%d: SIGTERM to this process (fault injection)", step)
        os.kill(os.getpid(), signal.SIGTERM)


def _hang_point(step: int, rank: int) -> None:
    if os.environ.get("SDFORGE_HANG_AT_STEP") != str(step):
        return
    if os.environ.get("SDFORGE_HANG_RANK", str(rank)) != str(rank):
        return
    log.warning("SDFORGE_HANG_AT_STEP=%d: rank %d hangs here (fault injection)", step, rank)
    while True:
        time.sleep(1)


def source_stats(job, report) -> dict[str, list]:
    """Per source name with samples in the step: ``[loss sum, samples]`` over every rank (from the agreement)."""
    agreed = report.agreed
    if agreed is None:
        return {}
    sources = job.data.sources
    return {name: [agreed.source_loss_sum[i], agreed.source_count[i]] for i, name in enumerate(sources)
            if agreed.source_count[i]}  # fmt: skip

