"""What a training run reports while it runs (main rank): MLflow step metrics, validation images, a
progress bar with ETA, and the phase's final figures.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from sdforge.config import Params
from sdforge.eval.grid import captioned_grid
from sdforge.tracking import stage_run, summarise
from sdforge.training.ledger import LEDGER_DIR
from sdforge.training.trainer import Trainer
from sdforge.training.validation import Validator

STEP_FILE = "steps.jsonl"
"""In the run dir: one JSON line per optimizer step (``step``, ``loss``, ``lr``, ``grad_norm``, ``step_time_s``,
``data_wait_s``, ``samples``), appended by the main rank and flushed each step. A resumed run appends the steps
it redoes after the checkpoint again: the last line of a step is the one that counts (:func:`read_steps`)."""

STEP_METRICS = ("loss", "lr", "grad_norm", "step_time_s", "data_wait_s", "samples_per_s")
"""Logged every ``train.log_every`` optimizer steps (plus ``gpu_mem_max_allocated_gb`` on CUDA)."""
PARENT_STEP_METRICS = ("loss", "lr")
"""Also logged on the phase's parent run (as ``train.loss``, ``train.lr``), so its page charts the curve."""
HEADLINE = ("final_loss", "mean_loss", "steps", "samples", "seconds", "samples_per_s")
"""The run's figures copied onto the phase's parent run."""


class StepLogger:
    """MLflow step metrics (main rank only), a progress bar with ETA, and the phase's final report.

    Every ``train.log_every`` optimizer steps it logs the window's means of ``loss``, ``grad_norm``,
    ``step_time_s`` and ``data_wait_s`` (time blocked on the loader), the current ``lr``,
    ``samples_per_s`` (all ranks: window samples × world ÷ window seconds), per source of the phase's mix
    ``loss.<source>`` (the window's mean loss over that source's samples, all ranks) and ``samples.<source>``
    (samples trained so far in the phase, resumed runs included: the sample ledger's counts) and, on CUDA,
    ``gpu_mem_max_allocated_gb`` (the peak since the previous log).
    """

    def __init__(self, params: Params, phase_name: str, tr: Trainer, run_dir: Path):
        self.steps_file = (Path(run_dir) / STEP_FILE).open("a", encoding="utf-8")
        self.every = params.train.log_every
        self.validator = Validator(params, tr) if params.train.validation_every else None
        self.tr = tr
        self.losses: list[float] = []
        self.window: list[dict] = []
        self.world = tr.dist.world
        self.source_samples = ledger_counts(run_dir, tr.ledger_segments)
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
            parent_params={"phase": params.phases[phase_name].model_dump()},
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
        for name, (_, count) in stats.get("sources", {}).items():
            self.source_samples[name] = self.source_samples.get(name, 0) + int(count)
        self.steps_file.write(json.dumps({"step": step, **stats}, sort_keys=True) + "\n")
        self.steps_file.flush()
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
        metrics.update(self._source_metrics())
        metrics["samples_per_s"] = sum(s["samples"] for s in self.window) * self.world / max(seconds, 1e-9)
        if self.cuda is not None:
            metrics["gpu_mem_max_allocated_gb"] = torch.cuda.max_memory_allocated(self.cuda) / 2**30
            torch.cuda.reset_peak_memory_stats(self.cuda)
        self.mlflow.log_metrics(metrics, step=step)
        summarise(self.mlflow, metrics={k: metrics[k] for k in PARENT_STEP_METRICS}, step=step)
        self.window = []

    def _source_metrics(self) -> dict[str, float]:
        """``loss.<source>`` over the window and ``samples.<source>`` so far (the counts advance every step)."""
        sums: dict[str, list[float]] = {}
        for stats in self.window:
            for name, (loss_sum, count) in stats.get("sources", {}).items():
                acc = sums.setdefault(name, [0.0, 0])
                acc[0] += loss_sum
                acc[1] += count
        out = {f"loss.{name}": acc[0] / acc[1] for name, acc in sums.items() if acc[1]}
        out.update({f"samples.{name}": n for name, n in self.source_samples.items()})
        return out

    def _log_validation(self, step: int) -> None:
        images = self.validator.images(self.tr)
        grid = captioned_grid(images, self.validator.prompts, columns=len(images))
        self.mlflow.log_image(grid, artifact_file=f"validation/step-{step:08d}.png")

    def finish(self, metrics: dict, out_dir: Path) -> None:
        # whole-run figures; names shared with the step series get a ``run_`` prefix (one series, one meaning)
        numeric = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        self.mlflow.log_metrics({f"run_{k}" if k in STEP_METRICS else k: v for k, v in numeric.items()})
        self.mlflow.set_tag("checkpoint", str(out_dir.resolve()))
        headline = {k: numeric[k] for k in HEADLINE if k in numeric}
        summarise(self.mlflow, metrics=headline, note=training_note(self.tr, metrics, out_dir))

    def close(self) -> None:
        self.steps_file.close()
        self.bar.close()
        self._ctx.__exit__(None, None, None)


def training_note(tr: Trainer, metrics: dict, out_dir: Path) -> str:
    """The training section of the phase's MLflow description: what was trained from what, how, and where
    the weights are."""
    phase = tr.phase
    gamma = "off" if phase.min_snr_gamma is None else f"{phase.min_snr_gamma:g}"
    losses = f"final loss {metrics['final_loss']:.4f}" if metrics.get("final_loss") is not None else "no loss"
    if metrics.get("mean_loss") is not None:
        losses += f" (mean {metrics['mean_loss']:.4f})"
    return (
        f"**Training**: {metrics['steps']} optimizer steps over {metrics['samples']} samples × {phase.epochs} "
        f"epoch(s) on {metrics['world_size']} process(es), from `{phase.init_from}` ({phase.init_weights} weights); "
        f"peak LR {phase.lr:g}, warmup {phase.warmup_steps} steps, CFG dropout {phase.cfg_dropout:g}, "
        f"Min-SNR γ {gamma}, batch {phase.batch_size} × {phase.grad_accum} accumulation per process. "
        f"{losses}; {metrics['seconds']:.0f} s, {metrics['samples_per_s']:.1f} samples/s.\n\n"
        f"**Weights**: `{out_dir}` (EMA: `unet_ema/`, live: `unet/`, diffusers format)."
    )


def ledger_counts(run_dir: Path, entries: list[dict]) -> dict[str, int]:
    """Samples per source in the ledger segments ``entries`` (what a resumed run had trained before)."""
    counts: dict[str, int] = {}
    for entry in entries:
        path = Path(run_dir) / LEDGER_DIR / entry["name"]
        if not path.is_file():
            continue
        column = pq.read_table(path, columns=["source"])["source"].cast("string")
        for item in pc.value_counts(column).to_pylist():
            counts[item["values"]] = counts.get(item["values"], 0) + item["counts"]
    return counts


def read_steps(run_dir: Path) -> dict[int, dict]:
    """``{step: stats}`` from a run dir's :data:`STEP_FILE`, the last line of each step winning (resumes redo steps).

    A line cut short by a kill (the last one) is skipped.
    """
    steps: dict[int, dict] = {}
    path = Path(run_dir) / STEP_FILE
    if not path.is_file():
        return steps
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        steps[int(record["step"])] = record
    return dict(sorted(steps.items()))


def write_loss_curve(run_dir: Path, path: Path) -> float | None:
    """Write the phase's step log (the last record of each step, :func:`read_steps`) as ``step,loss,lr`` CSV at
    ``path``; return the mean loss over those steps (None when there are none)."""
    steps = read_steps(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(("step", "loss", "lr"))
        out.writerows((step, f"{r['loss']:.6g}", f"{r['lr']:.6g}") for step, r in steps.items())
    losses = [r["loss"] for r in steps.values()]
    return round(sum(losses) / len(losses), 6) if losses else None
