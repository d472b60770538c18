"""Stage ``train@<phase>``: train the UNet on the phase's latent mix, from the previous phase's weights.

Runs in-process for one process (CPU demo, one GPU); with ``train.nproc_per_node > 1`` or
``train.nnodes > 1`` the entry re-executes itself under ``torchrun`` (:mod:`stages.launch`; DDP: NCCL
on CUDA, gloo on CPU) and exits with its status. Rank 0 alone exports the weights, writes the
metrics JSON and logs to MLflow; the launcher only waits and forwards SIGTERM/SIGINT.
Resumable: checkpoints go to ``${paths.runs}/<phase>/`` (not a DVC output, so they survive a
killed ``dvc repro``); a rerun with the same inputs continues from the newest good checkpoint
mid-epoch. Output ``${paths.checkpoints}/<phase>/``: ``unet/`` (live), ``unet_ema/`` (EMA),
``state.json``. The loop itself is :mod:`stages.trainer`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from stages.checkpoints import resume_point
from stages.common import InputError, setup_logging, stage_cli, write_json
from stages.config import ConfigError, Params, Train, load_params
from stages.distributed import init_distributed
from stages.launch import launch, needs_launch, torchrun_command
from stages.trainer import LOSS_TAIL, Trainer, train_loop
from stages.validation import Validator

log = logging.getLogger(__name__)


def fingerprint(*files_or_dirs: Path, extra: dict) -> str:
    """Hash of the phase's inputs: a run dir from other inputs is stale and must not be resumed."""
    h = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for root in files_or_dirs:
        for f in sorted([root] if root.is_file() else root.rglob("*")):
            if f.is_file():
                h.update(f.relative_to(root.parent).as_posix().encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _prepare_run_dir(run_dir: Path, fp: str, is_main: bool) -> None:
    stamp = run_dir / "fingerprint.txt"
    if is_main:
        if run_dir.exists() and (not stamp.is_file() or stamp.read_text().strip() != fp):
            log.warning("%s holds a run from other inputs; starting this phase afresh", run_dir)
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        stamp.write_text(fp + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def export_phase(tr: Trainer, out_dir: Path, final_loss: float | None) -> None:
    """Write ``unet/`` (live), ``unet_ema/`` and ``state.json`` — the phase's DVC output."""
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    tr.unet.save_pretrained(out_dir / "unet", safe_serialization=True)
    tr.ema.store(tr.unet.parameters())
    tr.ema.copy_to(tr.unet.parameters())
    tr.unet.save_pretrained(out_dir / "unet_ema", safe_serialization=True)
    tr.ema.restore(tr.unet.parameters())
    write_json(
        out_dir / "state.json",
        {
            "phase": tr.phase_name,
            "step": tr.progress.step,
            "epochs": tr.progress.epoch,
            "final_loss": final_loss,
        },
    )


def run(params: Params, phase_name: str) -> dict:
    """Train one phase (resuming if possible); export its weights; return metrics."""
    torch.manual_seed(params.train.seed)
    dist = init_distributed()
    tr = Trainer(params, phase_name, dist)
    paths = params.paths
    run_dir = Path(paths.runs) / phase_name
    fp = fingerprint(
        Path(paths.mixes) / f"{phase_name}.parquet",
        Path(paths.checkpoints) / tr.phase.init_from,
        extra={
            "phase": tr.phase.model_dump(),
            "train": params.train.model_dump(exclude=NOT_TRAINING),
            "world": dist.world,
        },
    )
    _prepare_run_dir(run_dir, fp, dist.is_main)
    found = resume_point(run_dir, rank=dist.rank, world=dist.world, s3_url=params.train.checkpoint_s3)
    if found:
        tr.restore(*found)
    resumed_at = tr.progress.step
    start = time.perf_counter()
    logger = _StepLogger(params, phase_name, tr) if dist.is_main else None
    try:
        losses = train_loop(tr, run_dir, on_step=logger.log if logger else None)
        metrics = _finish(params, phase_name, tr, losses, resumed_at, time.perf_counter() - start, logger)
    finally:
        if logger:
            logger.close()
    if dist.world > 1:
        torch.distributed.destroy_process_group()
    return metrics


def _finish(params: Params, phase_name: str, tr: Trainer, losses, resumed_at: int, elapsed: float, logger) -> dict:
    """The phase's metrics; on the main rank also the export and the final MLflow logging."""
    dist, paths = tr.dist, params.paths
    trained = tr.progress.step - resumed_at
    final_loss = _tail_mean(losses)
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
        "world_size": dist.world,
        "seconds": round(elapsed, 2),
        "samples_per_s": round(
            trained * tr.phase.batch_size * tr.phase.grad_accum * dist.world / max(elapsed, 1e-9), 2
        ),
    }
    if dist.is_main:
        export_phase(tr, Path(paths.checkpoints) / phase_name, final_loss)
        logger.finish(metrics, Path(paths.checkpoints) / phase_name)
    return metrics


def _tail_mean(values: list[float], n: int = LOSS_TAIL) -> float | None:
    tail = values[-n:]
    return round(sum(tail) / len(tail), 6) if tail else None


NOT_TRAINING = {"validation_every", "validation_prompts"}
"""``train`` settings that do not change the weights: changing them keeps a run's checkpoints resumable."""

STEP_METRICS = ("loss", "lr", "grad_norm", "step_time_s", "data_wait_s", "samples_per_s")
"""Logged every ``train.log_every`` optimizer steps (plus ``gpu_mem_max_allocated_gb`` on CUDA)."""


class _StepLogger:
    """MLflow step metrics (main rank only), a progress bar with ETA, and the phase's final report.

    Every ``train.log_every`` optimizer steps it logs the window's means of ``loss``, ``grad_norm``,
    ``step_time_s`` and ``data_wait_s`` (time blocked on the loader), the current ``lr``,
    ``samples_per_s`` (all ranks: window samples × world ÷ window seconds) and, on CUDA,
    ``gpu_mem_max_allocated_gb`` (the peak since the previous log).
    """

    def __init__(self, params: Params, phase_name: str, tr: Trainer):
        from tqdm import tqdm

        from stages.tracking import stage_run

        self.every = params.train.log_every
        self.validator = Validator(params, tr) if params.train.validation_every else None
        self.tr = tr
        self.losses: list[float] = []
        self.window: list[dict] = []
        self.world = tr.dist.world
        self.cuda = tr.dist.device if tr.dist.device.type == "cuda" else None
        self._ctx = stage_run(
            params.tracking,
            phase_name,
            "train",
            {
                "phase": params.phases[phase_name].model_dump(),
                "train": params.train.model_dump(),
                "unet": params.models.unet.model_dump(),
                "run": {"world": tr.dist.world, "total_steps": tr.total_steps, "device": str(tr.dist.device)},
            },
        )
        self.mlflow = self._ctx.__enter__()
        self.bar = tqdm(
            total=tr.total_steps,
            initial=tr.progress.step,
            desc=f"train@{phase_name}",
            unit="step",
            disable=not params.train.progress_bar or os.environ.get("SDFORGE_PROGRESS", "1") == "0",
        )

    def log(self, step: int, stats: dict) -> None:
        self.losses.append(stats["loss"])
        self.window.append(stats)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{stats['loss']:.4f}")
        if self.validator and self.validator.due(step):
            self._log_validation(step)
        if step % self.every:
            return
        n, seconds = len(self.window), sum(s["step_time_s"] for s in self.window)
        metrics = {k: sum(s[k] for s in self.window) / n for k in ("loss", "grad_norm", "step_time_s", "data_wait_s")}
        metrics["lr"] = stats["lr"]
        metrics["samples_per_s"] = sum(s["samples"] for s in self.window) * self.world / max(seconds, 1e-9)
        if self.cuda is not None:
            metrics["gpu_mem_max_allocated_gb"] = torch.cuda.max_memory_allocated(self.cuda) / 2**30
            torch.cuda.reset_peak_memory_stats(self.cuda)
        self.mlflow.log_metrics(metrics, step=step)
        self.window = []

    def _log_validation(self, step: int) -> None:
        from stages.eval_grid import captioned_grid

        images = self.validator.images(self.tr)
        grid = captioned_grid(images, self.validator.prompts, columns=len(images))
        self.mlflow.log_image(grid, artifact_file=f"validation/step-{step:08d}.png")

    def finish(self, metrics: dict, out_dir: Path) -> None:
        # whole-run figures; names shared with the step series get a ``run_`` prefix (one series, one meaning)
        numeric = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        self.mlflow.log_metrics({f"run_{k}" if k in STEP_METRICS else k: v for k, v in numeric.items()})
        self.mlflow.set_tag("checkpoint", str(out_dir.resolve()))

    def close(self) -> None:
        self.bar.close()
        self._ctx.__exit__(None, None, None)


def _cli_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stages.train")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--item", required=True)
    return parser.parse_args(argv)


def _launch_config(argv: list[str]) -> Train | None:
    """``params.train`` if readable (else ``None``: :func:`stage_cli` then reports the error)."""
    try:
        return load_params(_cli_args(argv).params).train
    except (SystemExit, ConfigError, OSError, ValueError):
        return None


def _relaunch(cfg: Train, argv: list[str]) -> None:
    """Run this stage under torchrun; a non-zero status fails the stage with that status."""
    setup_logging()
    phase = _cli_args(argv).item
    rc = launch(torchrun_command(cfg, argv, module="stages.train"))
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


def _rank_cli(argv: list[str]) -> None:
    """A non-zero rank: train, but leave the metrics JSON (and everything else written once) to rank 0."""
    args = _cli_args(argv)
    setup_logging()
    try:
        run(load_params(args.params), args.item)
    except (ConfigError, InputError) as err:
        log.error("%s", err)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.train --params params.yaml --item <phase>``.

    One process: trains here. Several (``train.nproc_per_node``/``nnodes``): re-executes itself under
    ``torchrun`` unless already a torchrun rank; rank 0 writes the metrics JSON, other ranks none.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = _launch_config(argv)
    if cfg is not None and needs_launch(cfg, os.environ):
        _relaunch(cfg, argv)
    elif int(os.environ.get("RANK", "0")) == 0:
        stage_cli("train", run, argv=argv)
    else:
        _rank_cli(argv)


if __name__ == "__main__":
    main()
