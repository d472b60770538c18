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
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.posthoc_ema import combine, gamma_of, synthesis_coefficients
from sdforge.config import Params
from sdforge.eval.sampling import saved_family
from sdforge.io import naming_write_faults
from sdforge.output_dirs import refuse_workspace_target, resolved
from sdforge.training.checkpoints import POSTHOC_DIR
from sdforge.training.hooks import Hook
from sdforge.training.sharded_state import gathered, shard_like
from sdforge.training.val_loss import HeldOutLoss, ValLossHook

log = logging.getLogger(__name__)

FIXED_EMA = "fixed-ema.safetensors"
"""In the run dir's ``POSTHOC_DIR`` beside the snapshots (``step-NNNNNNNN.safetensors``: tensors
``<profile>/<parameter>``, fp32, metadata ``step`` and ``sigma_rels``), when a rebuilt EMA was chosen: the
fixed-decay EMA it replaced (tensors ``<parameter>``), so that one stays usable (:func:`candidate_weights`)."""
FIXED = "fixed"
"""The candidate name of the fixed-decay EMA (the others are named by their σ_rel, ``f"{σ:g}"``)."""


def snapshot_steps(total_steps: int, count: int) -> list[int]:
    """``count`` evenly spaced optimizer steps of a phase of ``total_steps``, the last one ``total_steps``."""
    return sorted({max(1, math.ceil(k * total_steps / count)) for k in range(1, count + 1)})


def snapshot_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / POSTHOC_DIR / f"step-{step:08d}.safetensors"


def write_snapshot(path: Path, step: int, sigma_rels: list[float], shadows: list[list[torch.Tensor]]) -> int:
    """Write every tracked EMA of optimizer step ``step`` atomically; its bytes."""
    tensors = {f"{i}/{k}": t.detach().cpu().contiguous()
               for i, shadow in enumerate(shadows) for k, t in enumerate(shadow)}  # fmt: skip
    tmp = path.with_suffix(".tmp")
    with naming_write_faults(path, "a post-hoc EMA snapshot", setting="paths.runs"):
        path.parent.mkdir(parents=True, exist_ok=True)
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


def candidate_weights(run_dir: Path, name: str, step: int | None = None) -> list[torch.Tensor]:
    """The trainable tensors of a finished phase's candidate ``name``: ``fixed`` (the fixed-decay EMA, kept when a
    rebuilt one was exported) or a σ_rel (e.g. ``"0.1"``) rebuilt from the run dir's snapshots at the last one's
    step — or, with ``step``, as it was at that snapshot step (from the snapshots up to it only). A
    FileNotFoundError names what is missing."""
    folder = Path(run_dir) / POSTHOC_DIR
    if name == FIXED:
        if step is not None:
            raise ValueError("the fixed EMA is kept at the phase's end only")
        with safe_open(folder / FIXED_EMA, "pt") as f:  # FileNotFoundError when the fixed EMA itself was exported
            return [f.get_tensor(str(k)) for k in range(len(f.keys()))]
    paths = [p for p in sorted(folder.glob("step-*.safetensors")) if step is None or _step_of(p) <= step]
    if not paths:
        raise FileNotFoundError(f"{folder}: no post-hoc EMA snapshot (train.posthoc_sigma_rels was off?)")
    with safe_open(paths[-1], "pt") as f:
        sigma_rels = json.loads(f.metadata()["sigma_rels"])
        count = sum(1 for k in f.keys() if k.startswith("0/"))
    gammas = [gamma_of(s) for s in sigma_rels]
    return rebuild(paths, sigma_rels, gammas, _step_of(paths[-1]), float(name), count)


def write_candidate_checkpoint(checkpoint_dir: Path, run_dir: Path, name: str, out_dir: Path,
                               step: int | None = None) -> Path:  # fmt: skip
    """A copy of a full fine-tune's phase checkpoint ``checkpoint_dir`` in ``out_dir`` whose ``unet_ema/`` holds
    candidate ``name`` (:func:`candidate_weights`, at ``step``) instead of the exported EMA: to sample or score
    another EMA length of a finished phase. Returns ``out_dir``; an :class:`~sdforge.io.InputError` when it
    overlaps the checkpoint or the run dir it reads."""
    read = {f"the checkpoint {checkpoint_dir}": resolved(checkpoint_dir), f"the run dir {run_dir}": resolved(run_dir)}
    refuse_workspace_target(out_dir, "out_dir", read, [])  # it is replaced whole below
    weights = candidate_weights(run_dir, name, step)
    shutil.rmtree(out_dir, ignore_errors=True)  # out_dir is the caller's scratch copy, never a phase's checkpoint
    shutil.copytree(checkpoint_dir, out_dir)
    unet = saved_family(out_dir / "unet_ema").model_class().from_pretrained(out_dir / "unet_ema")
    params = [p for p in unet.parameters() if p.requires_grad]
    if len(params) != len(weights):
        raise ValueError(f"{run_dir}: candidate {name} has {len(weights)} tensors, the UNet {len(params)} "
                         "(an adapter phase? only full fine-tunes are rebuilt into a UNet)")  # fmt: skip
    with torch.no_grad():
        for p, t in zip(params, weights, strict=True):
            p.copy_(t.to(p.dtype))
    unet.save_pretrained(out_dir / "unet_ema", safe_serialization=True)
    return out_dir


def _step_of(path: Path) -> int:
    with safe_open(path, "pt") as f:
        return int(f.metadata()["step"])


def _profile(path: Path, profile: int, count: int) -> list[torch.Tensor]:
    with safe_open(path, "pt") as f:
        return [f.get_tensor(f"{profile}/{k}") for k in range(count)]


class PosthocEmaHook(Hook):
    """Snapshots while training (main rank) and, at the end, the choice of the exported EMA (main rank).

    With ``train.checkpoint_s3`` the snapshots are uploaded with the checkpoints (each once, before the checkpoint
    of its step) and a run resumed from S3 fetches those up to its checkpoint. One that is still missing (no
    upload, a failed one) makes the phase export the fixed-decay EMA with a warning and
    ``posthoc_ema.missing_snapshots`` > 0 rather than fail the phase at its end."""

    def __init__(self, params: Params, phase_name: str, run_dir: Path, val_loss: ValLossHook | None = None):
        self.params, self.phase_name, self.run_dir = params, phase_name, Path(run_dir)
        self.val_loss = val_loss
        """The run's validation-loss hook (it ends first): its held-out set, and its end measurement of the fixed
        EMA, are reused instead of read and measured again."""
        self.cfg = params.train
        self.steps: list[int] = []
        self.metrics: dict = {}
        self.chosen: dict[str, float] | None = None

    def start(self, job) -> None:
        self.steps = snapshot_steps(job.plan.total_steps, self.cfg.posthoc_snapshots)

    def busy_after(self, step: int) -> bool:
        return step in self.steps

    def after_step(self, job, report) -> None:
        main = job.dist.is_main
        if report.step not in self.steps or not (main or job.model.sharded):
            return
        with job.busy("posthoc snapshot"):
            job.optim.settle()
            ema = job.optim.posthoc
            # sharded: every rank takes part in gathering each whole tensor, the main rank keeps and writes them
            shadows = [[gathered(t, main) for t in shadow] for shadow in ema.shadows]
            if main:
                write_snapshot(snapshot_path(self.run_dir, report.step), report.step, ema.sigma_rels, shadows)

    def end(self, job) -> None:
        """Choose the exported EMA (the main rank; every rank of a sharded model, whose forward is collective)."""
        if not (job.dist.is_main or job.model.sharded):
            return
        start = time.perf_counter()
        with job.busy("posthoc choice"):
            best, scores = self._choose(job)
        self.metrics.update({f"posthoc_ema.val_loss.{name}": round(m["val_loss"], 6) for name, m in scores.items()})
        self.metrics.update({"posthoc_ema.sigma_rel": 0.0 if best == FIXED else float(best),
                             "posthoc_ema.snapshots": len(self.steps),
                             "posthoc_ema.seconds": round(time.perf_counter() - start, 2)})  # fmt: skip
        self.chosen = scores[best]
        log.info("post-hoc EMA: %s chosen (validation loss %s)", best,
                 {name: round(m["val_loss"], 5) for name, m in scores.items()})  # fmt: skip

    def _choose(self, job) -> tuple[str, dict[str, dict]]:
        """Score the fixed EMA and each candidate σ_rel (one rebuilt at a time); put the best into the EMA's
        weights (what the export writes). The best's name and every candidate's validation-loss figures."""
        held_out = self.val_loss.held_out if self.val_loss is not None else None
        held_out = held_out or HeldOutLoss.for_phase(self.params, self.phase_name)
        if held_out is None:
            raise ValueError(f"train@{self.phase_name}: post-hoc EMA needs held-out samples; set train.held_out > 0")
        paths = [snapshot_path(self.run_dir, s) for s in self.steps]
        missing = [str(p) for p in paths if not p.is_file()]
        if job.model.sharded:  # the main rank's view: it wrote them, and the others may be ahead of its last write
            box = [missing]
            torch.distributed.broadcast_object_list(box, src=0)
            missing = box[0]
        ema, step = job.optim.posthoc, job.state.progress.step
        scores, best, best_weights = {FIXED: self._fixed_score(job, held_out, step)}, FIXED, None
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
            self._keep_fixed(job)
            with torch.no_grad():
                for shadow, t in zip(job.optim.ema.shadow_params, best_weights, strict=True):
                    shadow.copy_(shard_like(t, shadow))
        return best, scores

    def _keep_fixed(self, job) -> None:
        """Write the fixed-decay EMA beside the snapshots (the main rank; every rank gathers a sharded one)."""
        main = job.dist.is_main
        fixed = {str(k): gathered(t, main) for k, t in enumerate(job.optim.ema.shadow_params)}
        if main:
            save_file({k: t.contiguous() for k, t in fixed.items()}, self.run_dir / POSTHOC_DIR / FIXED_EMA)

    def _fixed_score(self, job, held_out: HeldOutLoss, step: int) -> dict[str, float]:
        """The fixed-decay EMA's validation loss at ``step``: the validation-loss hook's end measurement, or
        measured here."""
        last = self.val_loss.last if self.val_loss is not None else None
        return last[1] if last is not None and last[0] == step else held_out.measure(job)

    def finish(self, job, metrics: dict) -> None:
        if self.chosen is None:
            return
        metrics.update(self.metrics)
        metrics.update({f"final_{k}": round(v, 6) for k, v in self.chosen.items()})  # what unet_ema/ scores
