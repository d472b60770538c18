"""Post-hoc EMA in training (``train.posthoc_sigma_rels``): snapshots of the tracked power-function EMAs while the
phase trains, and at its end the rebuild of every ``train.posthoc_candidates`` σ_rel from them, scored with the
fixed-decay EMA by the validation loss; the best becomes the phase's ``unet_ema/``.

The tracked EMAs are part of the optimization's checkpoint state (exact resume); their snapshots are written by
the main rank to the run dir's ``posthoc/step-NNNNNNNN.safetensors`` at ``train.posthoc_snapshots`` evenly spaced
steps (the last one at the phase's end), before that step's checkpoint, so a resumed run finds every snapshot
up to its checkpoint and rewrites the later ones identically. Maths: :mod:`model.posthoc_ema`; docs/EVAL.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.posthoc_ema import combine, synthesis_coefficients
from sdforge.config import Params
from sdforge.training.hooks import Hook
from sdforge.training.val_loss import HeldOutLoss

log = logging.getLogger(__name__)

POSTHOC_DIR = "posthoc"
"""In the run dir: ``step-NNNNNNNN.safetensors``, tensors ``<profile>/<parameter>`` (fp32), metadata ``step`` and
``sigma_rels``."""


def snapshot_steps(total_steps: int, count: int) -> list[int]:
    """``count`` evenly spaced optimizer steps of a phase of ``total_steps``, the last one ``total_steps``."""
    return sorted({max(1, math.ceil(k * total_steps / count)) for k in range(1, count + 1)})


def snapshot_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / POSTHOC_DIR / f"step-{step:08d}.safetensors"


def write_snapshot(path: Path, step: int, sigma_rels: list[float], shadows: list[list[torch.Tensor]]) -> int:
    """Write every tracked EMA of optimizer step ``step`` atomically; its bytes."""
    tensors = {f"{i}/{k}": t.detach().cpu().contiguous()
               for i, shadow in enumerate(shadows) for k, t in enumerate(shadow)}  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"step": str(step), "sigma_rels": json.dumps(sigma_rels)})
    os.replace(tmp, path)
    return path.stat().st_size


def rebuild(paths: list[Path], sigma_rels: list[float], gammas: list[float], step: int, sigma_rel: float,
            count: int) -> list[torch.Tensor]:  # fmt: skip
    """The σ_rel EMA at optimizer step ``step`` rebuilt from the snapshot files ``paths`` (each holding the
    ``sigma_rels`` profiles of ``count`` tensors)."""
    entries = [(p, i, _step_of(p)) for p in paths for i in range(len(sigma_rels))]
    coefficients = synthesis_coefficients([s for _, _, s in entries], [gammas[i] for _, i, _ in entries], step,
                                          sigma_rel)  # fmt: skip
    return combine((c, _profile(p, i, count)) for c, (p, i, _) in zip(coefficients, entries, strict=True))


def _step_of(path: Path) -> int:
    with safe_open(path, "pt") as f:
        return int(f.metadata()["step"])


def _profile(path: Path, profile: int, count: int) -> list[torch.Tensor]:
    with safe_open(path, "pt") as f:
        return [f.get_tensor(f"{profile}/{k}") for k in range(count)]


class PosthocEmaHook(Hook):
    """Snapshots while training (main rank) and, at the end, the choice of the exported EMA (main rank).

    The snapshots live in the run dir only (not uploaded with ``train.checkpoint_s3``): a run resumed on another
    machine lacks the earlier ones, and then exports the fixed-decay EMA with a warning and
    ``posthoc_ema.missing_snapshots`` > 0 rather than fail the phase at its end."""

    def __init__(self, params: Params, phase_name: str, run_dir: Path):
        self.params, self.phase_name, self.run_dir = params, phase_name, Path(run_dir)
        self.cfg = params.train
        self.steps: list[int] = []
        self.metrics: dict = {}
        self.chosen: dict[str, float] | None = None

    def start(self, job) -> None:
        self.steps = snapshot_steps(job.plan.total_steps, self.cfg.posthoc_snapshots)

    def busy_after(self, step: int) -> bool:
        return step in self.steps

    def after_step(self, job, report) -> None:
        if job.dist.is_main and report.step in self.steps:
            with job.busy("posthoc snapshot"):
                job.optim.settle()
                ema = job.optim.posthoc
                write_snapshot(snapshot_path(self.run_dir, report.step), report.step, ema.sigma_rels, ema.shadows)

    def end(self, job) -> None:
        if not job.dist.is_main:
            return
        start = time.perf_counter()
        with job.busy("posthoc choice"):
            best, scores = self._choose(job)
        self.metrics.update({f"posthoc_ema.val_loss.{name}": round(m["val_loss"], 6) for name, m in scores.items()})
        self.metrics.update({"posthoc_ema.sigma_rel": 0.0 if best == "fixed" else float(best),
                             "posthoc_ema.snapshots": len(self.steps),
                             "posthoc_ema.seconds": round(time.perf_counter() - start, 2)})  # fmt: skip
        self.chosen = scores[best]
        log.info("post-hoc EMA: %s chosen (validation loss %s)", best,
                 {name: round(m["val_loss"], 5) for name, m in scores.items()})  # fmt: skip

    def _choose(self, job) -> tuple[str, dict[str, dict]]:
        """Score the fixed EMA and each candidate σ_rel (one rebuilt at a time); put the best into the EMA's
        weights (what the export writes). The best's name and every candidate's validation-loss figures."""
        held_out = HeldOutLoss.for_phase(self.params, self.phase_name)
        if held_out is None:
            raise ValueError(f"train@{self.phase_name}: post-hoc EMA needs held-out samples; set train.held_out > 0")
        paths = [snapshot_path(self.run_dir, s) for s in self.steps]
        missing = [str(p) for p in paths if not p.is_file()]
        ema, step = job.optim.posthoc, job.state.progress.step
        scores, best, best_weights = {"fixed": held_out.measure(job)}, "fixed", None
        self.metrics["posthoc_ema.missing_snapshots"] = len(missing)
        if missing:  # a run resumed on another machine from checkpoint_s3: the snapshots stayed on the old disk
            log.warning("post-hoc EMA: %d snapshot(s) missing (%s): exporting the fixed-decay EMA, no candidate "
                        "rebuilt (posthoc_ema.missing_snapshots)", len(missing), missing[:3])  # fmt: skip
            return best, scores
        for sigma in self.cfg.posthoc_candidates:
            weights = rebuild(paths, ema.sigma_rels, ema.gammas, step, sigma, len(job.model.trainable))
            name = f"{sigma:g}"
            scores[name] = held_out.measure(job, weights)
            if scores[name]["val_loss"] < scores[best]["val_loss"]:
                best, best_weights = name, weights
        if best_weights is not None:
            with torch.no_grad():
                for shadow, t in zip(job.optim.ema.shadow_params, best_weights, strict=True):
                    shadow.copy_(t.to(shadow.device, shadow.dtype))
        return best, scores

    def finish(self, job, metrics: dict) -> None:
        if self.chosen is None:
            return
        metrics.update(self.metrics)
        metrics.update({f"final_{k}": round(v, 6) for k, v in self.chosen.items()})  # what unet_ema/ scores
