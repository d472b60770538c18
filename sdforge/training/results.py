"""What a finished phase leaves: its weights in ``${paths.checkpoints}/<phase>/`` (``unet/``, ``unet_ema/``,
``state.json``, an adapter phase's ``adapter/`` and ``adapter_ema/``, the sample ledger), its loss curve, and its
metrics (with the ledger's exactly-once audit and the realised data and caption mix)."""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import pyarrow.parquet as pq
import torch

from model.speed import compile_seconds
from sdforge.io import fresh_folder, loss_curve_path, naming_write_faults, write_json
from sdforge.training.ledger import audit, caption_summary, read_ledger, source_summary
from sdforge.training.reporting import write_loss_curve
from sdforge.training.state import LOSS_TAIL

log = logging.getLogger(__name__)

EXPORT_KEPT = "the run's checkpoints are intact: a rerun exports again from the last one"


def phase_metrics(job, resumed_at: int, elapsed: float) -> dict:
    """Every rank: the phase's figures (``final_loss`` averaged over the ranks, each rank's being over its own
    slice of the data)."""
    dist, plan, params = job.dist, job.plan, job.params
    trained = job.state.progress.step - resumed_at
    final_loss = tail_mean(job.state.losses)
    if dist.world > 1 and final_loss is not None:
        t = torch.tensor([final_loss], dtype=torch.float64, device=dist.device)
        torch.distributed.all_reduce(t)
        final_loss = round(float(t) / dist.world, 6)
    metrics = {
        "steps": job.state.progress.step,
        "total_steps": plan.total_steps,
        "resumed_at_step": resumed_at,
        "samples": len(job.data),
        "epochs": job.state.progress.epoch,
        "final_loss": final_loss,
        "mean_loss": None,
        "world_size": dist.world,
        "seconds": round(elapsed, 2),
        "samples_per_s": round(trained * plan.global_batch / max(elapsed, 1e-9), 2),
        "global_batch": plan.global_batch,
        "parallel": "fsdp" if job.model.sharded else "ddp",
    }
    metrics.update(resolution=params.phase_resolution(job.phase_name), objective=job.objective, **plan.bucket_counts)
    metrics.update(job.model.parameter_counts())
    metrics.update(job.memory_metrics())
    metrics.update(job.side_input_metrics())
    if job.cfg.compile != "off":
        metrics["compile.seconds"] = round(compile_seconds(), 2)  # this process's compile wall time
    return metrics


def export_results(job, run_dir: Path, metrics: dict) -> None:
    """Main rank: the loss curve (``mean_loss`` into ``metrics``), the exported weights and the ledger figures."""
    params, out_dir = job.params, Path(job.params.paths.checkpoints) / job.phase_name
    curve = loss_curve_path(params.paths.metrics, job.phase_name)
    with naming_write_faults(curve, "the loss curve", setting="paths.metrics", kept=EXPORT_KEPT):
        metrics["mean_loss"] = write_loss_curve(run_dir, curve)
    with naming_write_faults(out_dir, "the phase's weights", setting="paths.checkpoints", kept=EXPORT_KEPT):
        export_phase(job, out_dir, metrics["final_loss"])
        metrics.update(ledger_metrics(job, run_dir, out_dir))


def export_phase(job, out_dir: Path, final_loss: float | None) -> None:
    """Write ``unet/`` (live), ``unet_ema/`` and ``state.json`` — the phase's DVC output; an adapter phase also
    writes ``adapter/`` (live) and ``adapter_ema/`` (diffusers LoRA files, :mod:`sdforge.training.adapter_files`).

    Called once training is over (the last resumable checkpoint is on disk): the optimizer state is
    released first and the EMA weights are copied into the UNet itself rather than swapped through a
    stored copy, so the export needs no memory beyond training's (at full size on a 24 GiB CPU machine the
    stored copy alone was 3.4 GB). Afterwards the job's UNet holds the EMA weights.
    """
    fresh_folder(out_dir, "the phase's weights", setting="paths.checkpoints")  # its own DVC output (persist: true)
    job.release_training_memory()
    gc.collect()
    job.model.export(out_dir, "unet", "adapter")
    job.optim.ema.copy_to(job.model.trainable)
    job.model.export(out_dir, "unet_ema", "adapter_ema")
    state = {
        "phase": job.phase_name,
        "step": job.state.progress.step,
        "epochs": job.state.progress.epoch,
        "final_loss": final_loss,
        "objective": job.objective,
        "flow_shift": job.phase.flow_shift,
        **job.model.describe(),
    }
    if job.phase.distill is not None:  # the samplers read it: few steps, guidance 1 (sdforge.eval.sampling)
        state["distill"] = job.phase.distill.model_dump()
    write_json(out_dir / "state.json", state)


def ledger_metrics(job, run_dir: Path, out_dir: Path) -> dict:
    """The ledger's audit (exactly-once per epoch), per-source counts, losses, realised vs planned mix and caption
    mix (``caption.<source>.synthetic`` …); the whole ledger is written to ``out_dir/ledger.parquet`` beside the
    exported weights."""
    ledger = read_ledger(run_dir, job.state.ledger_segments)
    pq.write_table(ledger, out_dir / "ledger.parquet", compression="zstd")
    phase = job.phase
    planned = {k: (v / phase.samples if phase.mix_is_counts else v) for k, v in phase.mix.items()}
    figures = audit(ledger, job.plan.all_epochs(job.data), job.plan.epoch_lengths)
    if figures["ledger.duplicates"] or figures["ledger.missing"] or figures["ledger.unplanned"]:
        log.error("train@%s: the sample ledger is not exactly-once: %s", job.phase_name, figures)
    captions = caption_summary(ledger, job.data.has_synthetic, phase.synthetic_share)
    return {**figures, **source_summary(ledger, planned), **captions}


def tail_mean(values: list[float], n: int = LOSS_TAIL) -> float | None:
    """The mean of the last ``n`` values (rounded), None when there are none."""
    tail = values[-n:]
    return round(sum(tail) / len(tail), 6) if tail else None


def leave_process_group(job) -> None:
    """Tear DDP down in an order that cannot deadlock (nothing to do on one process).

    gloo's worker threads release a finished collective's tensors, which needs the GIL; the process group's
    destructor joins those threads while holding it. Freed at ``run``'s return (the DDP reducer holds the
    group), a rank hung about one run in four. A barrier lets the workers finish (waiting releases the GIL),
    and the reducer is freed while the default group still holds the process group alive.
    """
    if job.dist.world == 1:
        if job.model.sharded and torch.distributed.is_initialized():  # the group sharding made for one process
            torch.distributed.destroy_process_group()
        return
    torch.distributed.barrier()
    job.model.release()
    torch.distributed.destroy_process_group()
