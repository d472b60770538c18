"""Stage ``train@<phase>``: train the UNet on the phase's latent mix, from the previous phase's weights.

One process trains in-process; ``train.nproc_per_node > 1`` or ``train.nnodes > 1`` re-executes the entry under
``torchrun`` (:mod:`sdforge.training.launch`; NCCL on CUDA, gloo on CPU); ``cluster.enabled`` with ``nnodes > 1``
submits a Kubernetes training job instead (:mod:`sdforge.cluster.train_job`). Rank 0 alone exports the weights,
writes the metrics JSON and logs to MLflow. Resumable: checkpoints in ``${paths.runs}/<phase>/`` (not a DVC
output: they survive a killed ``dvc repro``); a rerun continues from the newest good one mid-epoch. Output
``${paths.checkpoints}/<phase>/``: ``unet/``, ``unet_ema/``, ``state.json``, ``adapter/`` / ``adapter_ema/``
(docs/ADAPTERS.md); ``${paths.metrics}/train_loss/<phase>.csv``. The loop: :mod:`sdforge.training.trainer`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import torch

from sdforge.cluster.train_job import run_cluster_stage, submits_job
from sdforge.config import ConfigError, Params, Train, load_params
from sdforge.io import InputError, loss_curve_path, setup_logging, stage_cli
from sdforge.training.distributed import init_distributed
from sdforge.training.exits import PREEMPTED, read_marker, write_marker
from sdforge.training.launch import launch, needs_launch, torchrun_command
from sdforge.training.phase_run import export_phase, keep_global_batch, leave_process_group, open_run_dir, tail_mean
from sdforge.training.preemption import Preempted, PreemptionNotice
from sdforge.training.resume import restore_newest
from sdforge.training.run_checks import ledger_metrics, rank_facts
from sdforge.training.step_log import StepLogger, write_loss_curve
from sdforge.training.trainer import Trainer, start_ledger, train_loop
from sdforge.training.watchdog import Watchdog, check_ranks_agree

log = logging.getLogger(__name__)


def run(params: Params, phase_name: str) -> dict:
    """Train one phase (resuming if possible); export its weights; return metrics.

    SIGTERM stops it at the next step boundary with a checkpoint (:class:`Preempted`, exit status 75 from the
    CLI); a hang trips the watchdog (status 76): :mod:`sdforge.training.exits`, docs/RESILIENCE.md.
    """
    torch.manual_seed(params.train.seed)
    notice = PreemptionNotice()
    try:
        return _train(params, phase_name, notice)
    finally:
        notice.close()


def _train(params: Params, phase_name: str, notice: PreemptionNotice) -> dict:
    dist = init_distributed()
    tr = Trainer(params, phase_name, dist)
    run_dir, fp = open_run_dir(params, tr)
    restored = restore_newest(run_dir, tr.restore, rank=dist.rank, world=dist.world, s3_url=params.train.checkpoint_s3)
    keep_global_batch(tr, run_dir, restored is not None)
    start_ledger(tr, run_dir)
    check_ranks_agree(dist, rank_facts(params, tr, fp))
    resumed_at = tr.progress.step
    start = time.perf_counter()
    logger = StepLogger(params, phase_name, tr, run_dir) if dist.is_main else None
    watchdog = Watchdog(dist, params.train.hang_timeout_s, run_dir=run_dir)
    try:
        losses = train_loop(tr, run_dir, on_step=logger.log if logger else None, notice=notice, watchdog=watchdog)
        watchdog.close()
        metrics = _finish(params, phase_name, tr, losses, resumed_at, time.perf_counter() - start, logger)
    except Preempted as stop:
        if dist.is_main:
            write_marker(run_dir, PREEMPTED, stop.record())
        leave_process_group(tr)
        raise
    finally:
        watchdog.close()
        if logger:
            logger.close()
    leave_process_group(tr)
    return metrics


def _finish(params: Params, phase_name: str, tr: Trainer, losses, resumed_at: int, elapsed: float, logger) -> dict:
    """The phase's metrics; on the main rank also the export and the final MLflow logging."""
    dist, paths = tr.dist, params.paths
    trained = tr.progress.step - resumed_at
    final_loss = tail_mean(losses)
    if dist.world > 1 and final_loss is not None:  # each rank's loss is over its own slice: average them
        t = torch.tensor([final_loss], dtype=torch.float64, device=dist.device)
        torch.distributed.all_reduce(t)
        final_loss = round(float(t) / dist.world, 6)
    metrics = {
        "steps": tr.progress.step,
        "total_steps": tr.total_steps,
        "resumed_at_step": resumed_at,
        "samples": len(tr.data),
        "epochs": tr.progress.epoch,
        "final_loss": final_loss,
        "mean_loss": None,
        "world_size": dist.world,
        "seconds": round(elapsed, 2),
        "samples_per_s": round(trained * tr.split.global_batch / max(elapsed, 1e-9), 2),
        "global_batch": tr.split.global_batch,
    }
    metrics.update(resolution=params.phase_resolution(phase_name), objective=tr.objective, **tr.bucket_counts)
    metrics.update(tr.parameter_counts())
    if dist.is_main:
        curve = loss_curve_path(paths.metrics, phase_name)
        metrics["mean_loss"] = write_loss_curve(Path(paths.runs) / phase_name, curve)
        export_phase(tr, Path(paths.checkpoints) / phase_name, final_loss)
        metrics.update(ledger_metrics(tr, Path(paths.runs) / phase_name, Path(paths.checkpoints) / phase_name))
        logger.finish(metrics, Path(paths.checkpoints) / phase_name)
    return metrics


def _cli_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stages.train")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--item", required=True)
    return parser.parse_args(argv)


def _launch_params(argv: list[str]) -> Params | None:
    """The params if readable (else ``None``: :func:`stage_cli` then reports the error)."""
    try:
        return load_params(_cli_args(argv).params)
    except (SystemExit, ConfigError, OSError, ValueError):
        return None


def _relaunch(cfg: Train, argv: list[str]) -> None:
    """Run this stage under torchrun; a non-zero status fails the stage with that status."""
    setup_logging()
    phase = _cli_args(argv).item
    started = time.time()
    rc = launch(torchrun_command(cfg, argv, module="stages.train"))
    marker = read_marker(_run_dir(argv), started) if rc != 0 else None
    if marker:
        status, info = marker
        log.warning("train@%s: the ranks stopped with status %d (%s); rerunning resumes", phase, status, info)
        raise SystemExit(status)
    if rc != 0:
        log.error(
            "train@%s: torchrun (%d node(s) x %d process(es)) exited with status %d; the failing rank's error "
            "is above. Checkpoints in the run dir are kept: rerunning resumes.",
            phase,
            cfg.nnodes,
            cfg.nproc_per_node,
            rc,
        )
        raise SystemExit(rc)
    log.info("train@%s: torchrun finished (rank 0 exported the weights and metrics)", phase)


def _run_dir(argv: list[str]) -> Path:
    args = _cli_args(argv)
    return Path(load_params(args.params).paths.runs) / args.item


def _rank_cli(argv: list[str]) -> None:
    """A non-zero rank: train, but leave the metrics JSON (and everything else written once) to rank 0."""
    args = _cli_args(argv)
    setup_logging()
    try:
        run(load_params(args.params), args.item)
    except (ConfigError, InputError) as err:
        log.error("%s", err)
        raise SystemExit(2) from None


def _exit_preempted(argv: list[str], stop: Preempted) -> None:
    item, why = _cli_args(argv).item, "rerunning, or the flow's retry, resumes from the newest checkpoint"
    log.warning("train@%s: %s; exiting with status %d (%s)", item, stop, PREEMPTED, why)
    raise SystemExit(PREEMPTED) from None


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.train --params params.yaml --item <phase>``.

    One process: trains here. Several (``train.nproc_per_node``/``nnodes``): re-executes itself under
    ``torchrun`` unless already a torchrun rank; rank 0 writes the metrics JSON, other ranks none.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    params = _launch_params(argv)
    if params is not None and submits_job(params, os.environ):
        args = _cli_args(argv)
        raise SystemExit(run_cluster_stage(Path(args.params), args.item))
    if params is not None and needs_launch(params.train, os.environ):
        return _relaunch(params.train, argv)
    try:
        if int(os.environ.get("RANK", "0")) == 0:
            stage_cli("train", run, argv=argv)
        else:
            _rank_cli(argv)
    except Preempted as stop:
        _exit_preempted(argv, stop)


if __name__ == "__main__":
    main()
