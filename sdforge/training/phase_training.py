"""Train one phase on this rank, start to end: assemble the job, open its run dir (moving a stale one aside),
restore the newest good checkpoint, check that every rank plans the same job, run the loop with the default
hooks plus the caller's, export (main rank) and return the phase's metrics.

SIGTERM stops the run at the next step boundary with a checkpoint (:class:`~sdforge.training.preemption.Preempted`,
exit status 75 from the CLI); a hang trips the watchdog (status 76): :mod:`sdforge.training.exits`,
docs/RESILIENCE.md.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from sdforge.config import Params
from sdforge.training.checkpoint_manager import CheckpointManager
from sdforge.training.distributed import init_distributed
from sdforge.training.hooks import CheckpointHook, FaultInjectionHook, Hook, Hooks, LedgerHook, PreemptionHook
from sdforge.training.inputs import phase_inputs
from sdforge.training.job import TrainJob
from sdforge.training.loop import train_loop
from sdforge.training.parallel import require_shared_folder
from sdforge.training.posthoc import PosthocEmaHook
from sdforge.training.preemption import Preempted, PreemptionNotice
from sdforge.training.reporting import StepRecordHook
from sdforge.training.results import export_results, leave_process_group, phase_metrics
from sdforge.training.run_dir import keep_global_batch, open_run_dir, stale_metrics
from sdforge.training.val_loss import ValLossHook
from sdforge.training.validation import ValidationHook
from sdforge.training.watchdog import WatchdogHook, check_ranks_agree

log = logging.getLogger(__name__)


def train_phase(params: Params, phase_name: str, hooks: list[Hook] | tuple = ()) -> dict:
    """Train ``phase_name`` (resuming if its run dir allows); export its weights; return its metrics.

    ``hooks`` (e.g. MLflow, :class:`~sdforge.training.reporting.TrackingHook`) run after the default reports and
    before the checkpoint and fault-injection hooks.
    """
    torch.manual_seed(params.train.seed)
    notice = PreemptionNotice()
    try:
        return _train(params, phase_name, notice, list(hooks))
    finally:
        notice.close()


def _train(params: Params, phase_name: str, notice: PreemptionNotice, extra: list[Hook]) -> dict:
    dist = init_distributed()
    job = TrainJob(params, phase_name, dist)
    inputs = phase_inputs(params, phase_name)
    runs = Path(params.paths.runs)
    run_dir, moved = open_run_dir(runs, phase_name, inputs, dist.is_main, params.train.checkpoint_s3)
    if job.model.sharded:
        require_shared_folder(run_dir, dist)  # every rank writes its shards there and reads all of them back
    manager = CheckpointManager(job, run_dir, inputs.fingerprint)
    restored = manager.restore_newest()
    keep_global_batch(job, run_dir, restored is not None)
    check_ranks_agree(dist, job.rank_facts(inputs.fingerprint))
    resumed_at, start = job.state.progress.step, time.perf_counter()
    hooks = Hooks(default_hooks(job, run_dir, notice, manager, extra))
    try:
        with hooks.running():
            train_loop(job, hooks)
            metrics = phase_metrics(job, resumed_at, time.perf_counter() - start)
            if job.model.sharded:  # every rank: the main rank gathers the whole weights to export
                job.release_training_memory()
                job.model.gather_for_export(job.optim.ema)
            if dist.is_main:
                export_results(job, run_dir, metrics)
                metrics.update(stale_metrics(runs), **{"run_dir.moved_aside": str(moved or "")})
            hooks.finish(job, metrics)
    except Preempted:
        leave_process_group(job)  # every rank stopped at the same step boundary
        raise
    leave_process_group(job)
    return metrics


def default_hooks(job, run_dir: Path, notice: PreemptionNotice, manager, extra: list[Hook]) -> list[Hook]:
    """The hooks of every run, in protocol order (:mod:`sdforge.training.hooks`), with ``extra`` after the
    reports."""
    cfg, main = job.cfg, job.dist.is_main
    # a distill phase's student outputs a consistency value, not the denoising target: no validation loss there
    val_loss = ValLossHook(job.params, job.phase_name) if cfg.held_out and job.phase.distill is None else None
    return [
        LedgerHook(),
        PreemptionHook(notice, manager, cfg.preempt_grace_s, run_dir),
        WatchdogHook(cfg.hang_timeout_s, run_dir),
        val_loss,
        PosthocEmaHook(job.params, job.phase_name, run_dir, val_loss) if job.optim.posthoc is not None else None,
        StepRecordHook(run_dir, cfg.progress_bar) if main else None,
        ValidationHook(job.params, run_dir) if cfg.validation_every else None,
        *extra,
        CheckpointHook(manager),
        FaultInjectionHook(manager),
    ]
