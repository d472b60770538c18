"""Issue 41's question for ``bench.demo_quality``: does the validation loss rank weights as the demo probe does?

For the last full phase (the demo's phase 7) of one run: every post-hoc EMA candidate (the fixed-decay EMA and each
``train.posthoc_candidates`` σ_rel rebuilt from the phase's snapshots) and the exported EMA of every earlier full
phase are scored twice — by the validation loss on that phase's held-out set
(:meth:`~sdforge.training.val_loss.HeldOutLoss.measure_unet`) and by the probe (``eval_grid`` on a scratch copy of
the checkpoint: the mean of colour and shape agreement on the seen and held-out prompts). The Spearman rank
correlation of −validation loss with the probe score is given over the candidates, over the phases and over
both; and the chosen candidate's probe score against the fixed EMA's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from scipy.stats import spearmanr

from model.denoisers import family
from sdforge.config import Params
from sdforge.training.checkpoints import POSTHOC_DIR
from sdforge.training.conditioning import Conditioning
from sdforge.training.posthoc import FIXED, FIXED_EMA, write_candidate_checkpoint
from sdforge.training.val_loss import HeldOutLoss
from stages import eval_grid

TRAJECTORY_SIGMA = 0.1
"""The EMA length whose course through a phase :func:`trajectory` follows (EDM2's usual choice)."""
PROBE = ("colour_agreement_seen", "shape_agreement_seen", "colour_agreement_held_out", "shape_agreement_held_out")
"""The probe score of a set of weights: the mean of these four agreements."""


def probe_score(grid: dict) -> float:
    """The mean of the :data:`PROBE` agreements of an ``eval_grid`` result."""
    return sum(grid[k] for k in PROBE) / len(PROBE)


def spearman(val_losses: list[float], scores: list[float]) -> float:
    """Rank correlation of −validation loss with the probe score (1: the same order); NaN when either is constant."""
    if len(set(val_losses)) < 2 or len(set(scores)) < 2:
        return float("nan")
    return float(spearmanr([-v for v in val_losses], scores).statistic)


class Scorer:
    """Validation loss (on one phase's held-out set) and probe score of a checkpoint folder's ``unet_ema/``."""

    def __init__(self, params: Params, phase: str):
        self.params, self.phase = params, phase
        self.held_out = HeldOutLoss.for_phase(params, phase)
        models, dtype = Path(params.paths.models), params.train.text_encoder_dtype
        self.family = family(params.models.denoiser.family)
        self.conditioning = Conditioning(models, torch.device("cpu"), dtype, self.family)
        self.square_only = params.eval.model_copy(update={"extra_sizes": []})  # the probe score: the square cells
        self.scratch = Path(params.paths.checkpoints).parent / "ema-study"

    def __call__(self, checkpoint: Path) -> tuple[float, float]:
        unet = self.family.model_class().from_pretrained(checkpoint / "unet_ema")
        val = self.held_out.measure_unet(unet, self.conditioning, self.params.phase_objective(self.phase))["val_loss"]
        grid = eval_grid.run(self.square_only, self.params.demo, Path(self.params.paths.models), checkpoint,
                             self.scratch / "eval")  # fmt: skip
        return val, probe_score(grid)


def trajectory(params: Params, phase: str, sigma_rel: float = TRAJECTORY_SIGMA) -> dict:
    """Phase ``phase``'s σ_rel EMA as it was at each snapshot step (rebuilt from the snapshots up to it): weights
    of rising quality, scored both ways; the rows (step, validation loss on the phase's held-out set, probe) and
    their rank correlation."""
    score, paths = Scorer(params, phase), params.paths
    steps = sorted(int(p.name[5:13]) for p in (Path(paths.runs) / phase / POSTHOC_DIR).glob("step-*.safetensors"))
    rows = []
    for step in steps:
        checkpoint = write_candidate_checkpoint(Path(paths.checkpoints) / phase, Path(paths.runs) / phase,
                                                f"{sigma_rel:g}", score.scratch / f"step-{step}", step)  # fmt: skip
        val, probe = score(checkpoint)
        rows.append({"step": step, "val_loss": val, "probe": probe})
    shutil.rmtree(score.scratch, ignore_errors=True)
    return {"rows": rows, "rho": spearman([r["val_loss"] for r in rows], [r["probe"] for r in rows])}


def study(params: Params, base: str, chosen: str | None = None) -> dict:
    """Score the candidates of phase ``base`` (``chosen``: the exported one's name; None: the lowest validation loss,
    as training chose) and the earlier full phases; the rows (kind, name, validation loss, probe score) and the
    correlations."""
    paths = params.paths
    score = Scorer(params, base)
    scratch = score.scratch
    names = list(params.phases)
    earlier = [n for n in names[: names.index(base)] if params.phases[n].adapter is None]
    candidates = [FIXED, *(f"{s:g}" for s in params.train.posthoc_candidates)]
    if chosen is None and not (Path(paths.runs) / base / POSTHOC_DIR / FIXED_EMA).is_file():
        chosen = FIXED  # the fixed EMA was exported (no rebuild beat it); else: the lowest below, as training chose
    rows, scored = [], {}
    for kind, name in [("candidate", c) for c in candidates] + [("phase", p) for p in [*earlier, base]]:
        if kind == "candidate" and name == chosen or kind == "phase" and name == base:
            checkpoint = Path(paths.checkpoints) / base  # the exported EMA itself
        elif kind == "candidate":
            checkpoint = write_candidate_checkpoint(Path(paths.checkpoints) / base, Path(paths.runs) / base, name,
                                                    scratch / name)  # fmt: skip
        else:
            checkpoint = Path(paths.checkpoints) / name
        if checkpoint not in scored:
            scored[checkpoint] = score(checkpoint)
        val, probe = scored[checkpoint]
        rows.append({"kind": kind, "name": name, "val_loss": val, "probe": probe})
    shutil.rmtree(scratch, ignore_errors=True)
    cands = [r for r in rows if r["kind"] == "candidate"]
    chosen = chosen or min(cands, key=lambda r: r["val_loss"])["name"]
    phases = [r for r in rows if r["kind"] == "phase"]
    by_name = {r["name"]: r for r in cands}
    return {
        "rows": rows,
        "rho_candidates": spearman([r["val_loss"] for r in cands], [r["probe"] for r in cands]),
        "rho_phases": spearman([r["val_loss"] for r in phases], [r["probe"] for r in phases]),
        "rho_all": spearman([r["val_loss"] for r in rows], [r["probe"] for r in rows]),
        "chosen": chosen,
        "chosen_probe": by_name[chosen]["probe"],
        "fixed_probe": by_name[FIXED]["probe"],
        "chosen_minus_fixed": by_name[chosen]["probe"] - by_name[FIXED]["probe"],
    }


def chosen_name(train_metrics: dict) -> str:
    """The exported candidate's name from a phase's train metrics (``posthoc_ema.sigma_rel``; 0: the fixed EMA)."""
    sigma = train_metrics.get("posthoc_ema.sigma_rel", 0.0)
    return FIXED if not sigma else f"{sigma:g}"
