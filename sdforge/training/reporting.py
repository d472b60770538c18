"""What a training run reports while it runs (main rank): the run dir's step record and a progress bar with
ETA (:class:`StepRecordHook`, always), and MLflow (:class:`TrackingHook`, added by the stage): step metrics,
validation images, the phase's final figures, and how the run ended.
"""

from __future__ import annotations

import csv
import json
import os
import time
import traceback
from pathlib import Path

import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch
from tqdm import tqdm

from sdforge.config import Params
from sdforge.tracking import stage_run, summarise
from sdforge.training.hooks import Hook, source_stats
from sdforge.training.ledger import LEDGER_DIR
from sdforge.training.preemption import Preempted

STEP_FILE = "steps.jsonl"
"""In the run dir: one JSON line per optimizer step (``step``, ``loss``, ``lr``, ``grad_norm``, ``step_time_s``,
``data_wait_s``, ``samples``, ``sources``; at a validation-loss step also ``val_loss*``,
:mod:`~sdforge.training.val_loss`), appended by the main rank and flushed each step. A resumed run
appends the steps it redoes after the checkpoint again: the last line of a step is the one that counts
(:func:`read_steps`)."""

STEP_METRICS = ("loss", "lr", "grad_norm", "step_time_s", "data_wait_s", "samples_per_s")
"""Logged every ``train.log_every`` optimizer steps (plus ``gpu_mem_max_allocated_gb`` on CUDA)."""
PARENT_STEP_METRICS = ("loss", "lr")
"""Also logged on the phase's parent run (as ``train.loss``, ``train.lr``), so its page charts the curve."""
PARENT_VAL_METRICS = ("val_loss",)
"""A hook's step figures also logged on the phase's parent run (``train.val_loss``)."""
HEADLINE = ("final_loss", "final_val_loss", "mean_loss", "steps", "samples", "seconds", "samples_per_s")
"""The run's figures copied onto the phase's parent run."""
END_REASON_TAG = "sdforge.end_reason"
"""On a train run that did not finish: why (preempted, hung, or the error), beside status KILLED or FAILED."""


def step_stats(job, report) -> dict:
    """The record of one step: ``loss``, ``lr``, ``grad_norm``, ``step_time_s`` (first batch wait to optimizer
    step done; checkpoint writes excluded), ``data_wait_s`` (of that, waiting for the loader), ``samples``
    (this rank's) and ``sources`` (per source: ``[loss sum, samples]`` over every rank)."""
    return {
        "loss": report.loss, "lr": report.lr, "grad_norm": report.grad_norm, "step_time_s": report.step_time_s,
        "data_wait_s": report.data_wait_s, "samples": int(report.per_sample.numel()),
        "sources": source_stats(job, report),
    }  # fmt: skip


class StepRecordHook(Hook):
    """Main rank: appends each step to the run dir's :data:`STEP_FILE` and moves a progress bar with ETA."""

    def __init__(self, run_dir: Path, progress_bar: bool):
        self.path, self.progress_bar = Path(run_dir) / STEP_FILE, progress_bar
        self.file = self.bar = None

    def start(self, job) -> None:
        self.file = self.path.open("a", encoding="utf-8")
        self.bar = tqdm(
            total=job.plan.total_steps,
            initial=job.state.progress.step,
            desc=f"train@{job.phase_name}",
            unit="step",
            disable=not self.progress_bar or os.environ.get("SDFORGE_PROGRESS", "1") == "0",
        )

    def after_step(self, job, report) -> None:
        record = {"step": report.step, **step_stats(job, report), **report.metrics}
        self.file.write(json.dumps(record, sort_keys=True) + "\n")
        self.file.flush()
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{report.loss:.4f}")

    def close(self, error: BaseException | None) -> None:
        if self.file is not None:
            self.file.close()
            self.bar.close()
            self.file = None


class TrackingHook(Hook):
    """MLflow (main rank): the train run under the phase's parent run, step metrics and artifacts, the final
    figures, and its end: FINISHED, or KILLED (preempted, interrupted, hung) / FAILED with the reason as the
    tag :data:`END_REASON_TAG`.

    Every ``train.log_every`` optimizer steps it logs the window's means of ``loss``, ``grad_norm``,
    ``step_time_s`` and ``data_wait_s`` (time blocked on the loader), the current ``lr``,
    ``samples_per_s`` (all ranks: window samples × world ÷ window seconds), per source of the phase's mix
    ``loss.<source>`` (the window's mean loss over that source's samples, all ranks) and ``samples.<source>``
    (samples trained so far in the phase, resumed runs included: the sample ledger's counts) and, on CUDA,
    ``gpu_mem_max_allocated_gb`` (the peak since the previous log).
    """

    def __init__(self, params: Params, phase_name: str, run_dir: Path):
        self.params, self.phase_name, self.run_dir = params, phase_name, Path(run_dir)
        self.every = params.train.log_every
        self.window: list[dict] = []
        self._ctx = self.mlflow = self.run_id = None
        self.ended = False

    def start(self, job) -> None:
        params, dist = self.params, job.dist
        self.world, self.cuda = dist.world, dist.device if dist.device.type == "cuda" else None
        self.source_samples = ledger_counts(self.run_dir, job.state.ledger_segments)
        logged = {
            "phase": params.phases[self.phase_name].model_dump(),
            "train": params.train.model_dump(),
            "unet": params.models.unet.model_dump(),
            "run": {"world": dist.world, "total_steps": job.plan.total_steps, "device": str(dist.device)},
        }
        parent = {"phase": params.phases[self.phase_name].model_dump()}
        self._ctx = stage_run(params.tracking, self.phase_name, "train", logged, parent_params=parent)
        self.mlflow = self._ctx.__enter__()
        run = self.mlflow.active_run()
        self.run_id = run.info.run_id if run is not None else None  # None: tracking off
        job.abort_listeners.append(self.abort)

    def after_step(self, job, report) -> None:
        stats = step_stats(job, report)
        for name, (_, count) in stats["sources"].items():
            self.source_samples[name] = self.source_samples.get(name, 0) + int(count)
        self.window.append(stats)
        for path, folder in report.artifacts:
            self.mlflow.log_artifact(str(path), folder)
        if report.metrics:
            self.mlflow.log_metrics(report.metrics, step=report.step)
            summarise(self.mlflow, metrics={k: report.metrics[k] for k in PARENT_VAL_METRICS if k in report.metrics},
                      step=report.step)  # fmt: skip
        if report.step % self.every == 0:
            self._log_window(report.step, stats["lr"])

    def _log_window(self, step: int, lr: float) -> None:
        n, seconds = len(self.window), sum(s["step_time_s"] for s in self.window)
        metrics = {k: sum(s[k] for s in self.window) / n for k in ("loss", "grad_norm", "step_time_s", "data_wait_s")}
        metrics["lr"] = lr
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
            for name, (loss_sum, count) in stats["sources"].items():
                acc = sums.setdefault(name, [0.0, 0])
                acc[0] += loss_sum
                acc[1] += count
        out = {f"loss.{name}": acc[0] / acc[1] for name, acc in sums.items() if acc[1]}
        out.update({f"samples.{name}": n for name, n in self.source_samples.items()})
        return out

    def finish(self, job, metrics: dict) -> None:
        """Whole-run figures (names shared with the step series get a ``run_`` prefix: one series, one meaning),
        the checkpoint folder, and the phase's training note on the parent run."""
        out_dir = Path(self.params.paths.checkpoints) / self.phase_name
        numeric = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
        self.mlflow.log_metrics({f"run_{k}" if k in STEP_METRICS else k: v for k, v in numeric.items()})
        self.mlflow.set_tag("checkpoint", str(out_dir.resolve()))
        headline = {k: numeric[k] for k in HEADLINE if k in numeric}
        summarise(self.mlflow, metrics=headline, note=training_note(job, metrics, out_dir))

    def abort(self, why: str) -> None:
        """The process is about to exit without unwinding (the hang watchdog, on its own thread): the train run
        ends as KILLED through the client (the fluent run stack belongs to the main thread)."""
        if self.run_id is None or self.ended:
            return
        self.ended = True
        client = self.mlflow.MlflowClient()
        client.set_tag(self.run_id, END_REASON_TAG, why[:5000])
        client.set_terminated(self.run_id, "KILLED", end_time=int(time.time() * 1000))

    def close(self, error: BaseException | None) -> None:
        if self._ctx is None:
            return
        if error is not None and not self.ended and self.run_id is not None:
            killed = isinstance(error, Preempted | KeyboardInterrupt | SystemExit)
            self.mlflow.set_tag(END_REASON_TAG, _reason(error)[:5000])
            self.mlflow.end_run("KILLED" if killed else "FAILED")  # the train run; its context then ends nothing
        self._ctx.__exit__(None, None, None)  # the parent run ends as it always did
        self._ctx = None


def _reason(error: BaseException) -> str:
    """One line on why a run ended early: the exception's type and message (last frame for an unexpected one)."""
    text = f"{type(error).__name__}: {error}".strip()
    if isinstance(error, Preempted | KeyboardInterrupt | SystemExit):
        return text
    frames = traceback.extract_tb(error.__traceback__)
    return f"{text} (at {frames[-1].filename}:{frames[-1].lineno})" if frames else text


def training_note(job, metrics: dict, out_dir: Path) -> str:
    """The training section of the phase's MLflow description: what was trained from what, how, and where
    the weights are."""
    phase = job.phase
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
    """Write the phase's step log (the last record of each step, :func:`read_steps`) as ``step,loss,lr,val_loss``
    CSV at ``path`` (``val_loss`` empty where it was not measured); return the mean loss over those steps (None
    when there are none)."""
    steps = read_steps(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(("step", "loss", "lr", "val_loss"))
        out.writerows((step, f"{r['loss']:.6g}", f"{r['lr']:.6g}", f"{r['val_loss']:.6g}" if "val_loss" in r else "")
                      for step, r in steps.items())  # fmt: skip
    losses = [r["loss"] for r in steps.values()]
    return round(sum(losses) / len(losses), 6) if losses else None
