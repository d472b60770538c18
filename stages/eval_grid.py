"""Stage ``eval_grid@<phase>``: sample the fixed prompts with the phase's EMA weights → captioned grid + metrics.

Output ``${paths.eval}/<phase>/``: ``grid.png`` (every prompt, captioned), ``strips/<category>.png`` (one
row per category: flip through ``eval/*/strips/portrait.png`` to follow a category across phases),
``images/NN.png`` (one per prompt, categories in file order), ``images/NN_<w>x<h>.png`` (prompt ``NN`` of
the first category at each ``eval.extra_sizes``: rows below the square cells in ``grid.png``),
``probe.json`` (demo prompts: does each image show the prompt's colour and shape?). Fixed seeds
(``eval.seed + i`` for prompt ``i`` of its category) and per-category steps/guidance make the images
comparable across phases. CLIP score and FID (square cells only) come from :mod:`sdforge.eval.metrics`
when their local weights are given (see ``docs/EVAL.md``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from PIL import Image

from sdforge.config import DemoData, Eval, Params
from sdforge.eval.coco import phase_end_samples, run_protocol
from sdforge.eval.control import evaluate_control, held_out_controls
from sdforge.eval.grid import (
    captioned_grid,
    check_extra_sizes,
    extra_prompts,
    probe_agreement,
    probe_extra_sizes,
    probe_truth,
    sample_categories,
    sample_extra_sizes,
    sampling_figures,
    size_name,
)
from sdforge.eval.metrics import image_metrics
from sdforge.eval.sampling import load_pipeline
from sdforge.io import fresh_folder, stage_cli, write_json
from sdforge.tracking import stage_run, summarise

log = logging.getLogger(__name__)

STRIPS = "strips"
COCO = "coco"
"""``eval.coco.phase_end_samples`` > 0: the COCO protocol's ``coco.json`` and ``coco_preview.png`` go here."""
HEADLINE = (
    "colour_agreement_seen", "shape_agreement_seen", "colour_agreement_held_out", "shape_agreement_held_out",
    "colour_agreement_concept", "shape_agreement_concept", "clip_score", "fid", "coco_fid", "coco_clip_score",
    "controlnet.canny_f1", "controlnet.canny_f1_base", "controlnet.placement_iou",
)
"""The eval figures copied onto the phase's parent run (those present: the probe at demo scale, CLIP score
and FID where their weights are given)."""


def run(cfg: Eval, demo: DemoData, models_dir: Path, checkpoint_dir: Path, out_dir: Path, control=None) -> dict:
    """Sample ``cfg.prompts`` (and the extra sizes) with EMA weights, write the grid, strips and images; return
    metrics. A bad ``eval.extra_sizes`` entry is an :class:`~sdforge.io.InputError` before any sampling. A ControlNet
    phase's prompts are drawn by its base; ``control`` (its held-out samples and Canny thresholds) is drawn with and
    without the ControlNet (:mod:`sdforge.eval.control`)."""
    steered = load_pipeline(models_dir, checkpoint_dir, use_ema=True)
    pipe = dataclasses.replace(steered, unet=steered.denoiser, controlnet=None)
    check_extra_sizes(pipe, cfg)
    samples = sample_categories(pipe, cfg)
    categories, prompts, images = (list(x) for x in zip(*samples, strict=True))
    extra = sample_extra_sizes(pipe, cfg)
    fresh_folder(out_dir, "the eval grid", setting="paths.eval")  # its own output (persist: true, dvc.yaml)
    write_images(cfg, out_dir, images, prompts, extra)
    (out_dir / STRIPS).mkdir(exist_ok=True)
    for category, texts in cfg.prompts.items():
        row = [img for c, img in zip(categories, images, strict=True) if c == category]
        captioned_grid(row, texts, len(texts)).save(out_dir / STRIPS / f"{category}.png")
    agreement = probe_agreement(images, prompts, demo)
    agreement.update(probe_truth(prompts, demo, int(images[0].shape[0])))
    agreement.update(probe_extra_sizes(extra, extra_prompts(cfg)[1], demo))
    truth = [v for k, v in agreement.items() if k.startswith("probe_truth_") and isinstance(v, float)]
    if truth and min(truth) < 1:
        log.warning("the probe misreads the demo's own renders (%s): its agreement is not trustworthy", agreement)
    (out_dir / "probe.json").write_text(json.dumps(agreement, indent=2) + "\n")
    metrics = {k: v for k, v in agreement.items() if k not in ("per_prompt", "extra_per_prompt")}
    metrics.update(
        {
            "sampled": 1,
            "images": len(images),
            "extra_images": sum(len(imgs) for imgs in extra.values()),
            "categories": len(cfg.prompts),
            "image_size": int(images[0].shape[0]),
            "checkpoint_hash": pipe.checkpoint_hash,
            **sampling_figures(pipe, cfg),
        }
    )
    fid = cfg.fid
    metrics.update(image_metrics(images, prompts, categories, cfg.clip_model_path, fid.inception_path,
                                 fid.reference_dir, fid.max_reference_images))  # fmt: skip
    if steered.controlnet is not None:
        metrics.update(evaluate_control(steered, control[0], cfg, control[1], demo, out_dir))
    return metrics


def write_images(cfg: Eval, out_dir: Path, images: list, prompts: list[str], extra: dict) -> None:
    """``images/NN.png``, ``images/NN_<w>x<h>.png`` (``extra``: size → images) and ``grid.png``: the square
    cells, then a row (or more, ``eval.columns`` wide) per extra size, each caption led by its size."""
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    for i, img in enumerate(images):
        Image.fromarray(img).save(out_dir / "images" / f"{i:02d}.png")
    rows = []
    for size, imgs in extra.items():
        for i, img in enumerate(imgs):
            Image.fromarray(img).save(out_dir / "images" / f"{i:02d}_{size_name(size)}.png")
        rows.append((imgs, [f"{size_name(size)} {p}" for p in extra_prompts(cfg)[1][: len(imgs)]]))
    captioned_grid(images, prompts, cfg.columns, rows).save(out_dir / "grid.png")


def scoring_eval(params: Params) -> Eval:
    """``params.eval`` with the scoring CLIP and Inception resolved (``models.eval_clip`` / ``fid_inception`` when
    ``eval.clip_model_path`` / ``eval.fid.inception_path`` are null)."""
    fid = params.eval.fid.model_copy(update={"inception_path": params.fid_inception_path()})
    return params.eval.model_copy(update={"clip_model_path": params.eval_clip_path(), "fid": fid})


SKIPPED = "skipped.json"


def record_skip(phase: str, out_dir: Path) -> dict:
    """A phase with ``eval_grid: false``: ``out_dir`` holds only ``skipped.json`` saying so; metrics say so."""
    fresh_folder(out_dir, "the eval grid", setting="paths.eval")  # its own output (persist: true, dvc.yaml)
    write_json(out_dir / SKIPPED, {"phase": phase, "sampled": False, "why": f"phases.{phase}.eval_grid is false"})
    return {"sampled": 0}


def run_stage(params: Params, phase: str) -> dict:
    """Resolve phase ``phase``'s paths from ``params``, run (or, with ``phases.<phase>.eval_grid: false``, record
    that it was not sampled), log to MLflow."""
    out_dir = Path(params.paths.eval) / phase
    parent_params = {"phase": params.phases[phase].model_dump()}
    if not params.phases[phase].eval_grid:
        metrics = record_skip(phase, out_dir)
        eval_params = params.eval.model_dump()
        with stage_run(params.tracking, phase, "eval_grid", eval_params, parent_params, deferrable=True) as mlflow:
            mlflow.log_metrics(metrics)
            summarise(mlflow, note=f"**Eval**: not sampled (`phases.{phase}.eval_grid: false`).")
        log.info("eval grid of %s not sampled (phases.%s.eval_grid: false)", phase, phase)
        return metrics
    checkpoint, spec = Path(params.paths.checkpoints) / phase, params.phases[phase].controlnet
    control = None
    if spec is not None:  # its held-out samples' captions and conditions; the condition's thresholds
        settings = getattr(params.conditions, spec.condition).model_dump()
        control = held_out_controls(params, phase, params.eval.control_samples), settings
    metrics = run(scoring_eval(params), params.demo, Path(params.paths.models), checkpoint, out_dir, control)
    if samples := phase_end_samples(params, phase):  # FID-5k at full scale (docs/EVAL.md "COCO protocol")
        metrics.update(run_protocol(params, checkpoint, samples, out_dir / COCO))
    with stage_run(params.tracking, phase, "eval_grid", params.eval.model_dump(), parent_params) as mlflow:
        mlflow.log_metrics({k: v for k, v in metrics.items() if isinstance(v, int | float)})
        mlflow.log_artifact(str(out_dir / "grid.png"))
        mlflow.log_artifact(str(out_dir / "probe.json"))
        mlflow.log_artifacts(str(out_dir / STRIPS), artifact_path=STRIPS)
        if (out_dir / COCO).is_dir():
            mlflow.log_artifacts(str(out_dir / COCO), artifact_path=COCO)
        mlflow.set_tag("grid", str((out_dir / "grid.png").resolve()))
        headline = {k: v for k, v in metrics.items() if k in HEADLINE and isinstance(v, int | float)}
        artifacts = [(out_dir / "grid.png", None), (out_dir / STRIPS, STRIPS)]
        summarise(mlflow, metrics=headline, note=eval_note(metrics, out_dir), artifacts=artifacts)
    log.info("eval grid: %s", (out_dir / "grid.png").resolve())
    return metrics


def eval_note(metrics: dict, out_dir: Path) -> str:
    """The eval section of the phase's MLflow description: the headline scores and where the images are."""
    scores = [
        f"{name} {metrics[key]:.0%} of {metrics[count]}"
        for key, name, count in (
            ("colour_agreement_seen", "colour (seen)", "probe_prompts_seen"),
            ("shape_agreement_seen", "shape (seen)", "probe_prompts_seen"),
            ("colour_agreement_held_out", "colour (held-out)", "probe_prompts_held_out"),
            ("shape_agreement_held_out", "shape (held-out)", "probe_prompts_held_out"),
            ("colour_agreement_concept", "colour (concept)", "probe_prompts_concept"),
            ("shape_agreement_concept", "shape (concept)", "probe_prompts_concept"),
        )
        if metrics.get(key) is not None
    ]
    scores += [f"{key.replace('_', ' ')} {metrics[key]:.4g}" for key in ("clip_score", "fid") if metrics.get(key)]
    coco = (("coco_fid", "FID"), ("coco_clip_score", "CLIP score"))
    scores += [f"COCO-{metrics['coco_samples']} {name} {metrics[key]:.4g}" for key, name in coco if metrics.get(key)]
    found = "; ".join(scores) or "no automatic score (give eval.clip_model_path / eval.fid for CLIP score and FID)"
    return (
        f"**Eval** ({metrics['images']} images, EMA weights): {found}. Grid: `grid.png` and `strips/` "
        f"(artifacts of this run; on disk `{out_dir}`)."
    )


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.eval_grid --params params.yaml --item <phase>``."""
    stage_cli("eval_grid", run_stage, argv=argv)


if __name__ == "__main__":
    main()
