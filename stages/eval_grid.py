"""Stage ``eval_grid@<phase>``: sample the fixed prompts with the phase's EMA weights → captioned grid + metrics.

Output ``${paths.eval}/<phase>/``: ``grid.png`` (every prompt, captioned), ``strips/<category>.png`` (one
row per category: flip through ``eval/*/strips/portrait.png`` to follow a category across phases),
``images/NN.png`` (one per prompt, categories in file order), ``probe.json`` (demo prompts: does each
image show the prompt's colour and shape?). Fixed seeds (``eval.seed + i`` for prompt ``i`` of its
category) and per-category steps/guidance make the images comparable across phases. CLIP score and
FID come from :mod:`stages.eval_metrics` when their local weights are given (see ``stages/EVAL.md``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from stages.common import stage_cli
from stages.config import DemoData, Eval, Params
from stages.demo_shapes import parse_caption, probe
from stages.sampling import generate, load_pipeline

log = logging.getLogger(__name__)

STRIPS = "strips"
CELL = 128
CAPTION_H = 28


def captioned_grid(images: list[np.ndarray], captions: list[str], columns: int) -> Image.Image:
    """Images upscaled (nearest) to ``CELL`` px, each with its caption under it, in ``columns`` columns."""
    rows = -(-len(images) // columns)
    grid = Image.new("RGB", (columns * CELL, rows * (CELL + CAPTION_H)), "white")
    draw = ImageDraw.Draw(grid)
    for i, (img, text) in enumerate(zip(images, captions, strict=True)):
        x, y = (i % columns) * CELL, (i // columns) * (CELL + CAPTION_H)
        grid.paste(Image.fromarray(img).resize((CELL, CELL), Image.NEAREST), (x, y))
        words = text.split()
        half = (len(words) + 1) // 2
        draw.text((x + 2, y + CELL + 1), " ".join(words[:half]), fill="black")
        draw.text((x + 2, y + CELL + 13), " ".join(words[half:]), fill="black")
    return grid


def probe_agreement(images: list[np.ndarray], prompts: list[str], demo: DemoData) -> dict:
    """Colour and shape agreement of the demo probe with each demo prompt; chance baselines."""
    results = []
    for img, prompt in zip(images, prompts, strict=True):
        try:
            want = parse_caption(prompt)
        except ValueError:
            continue
        got = probe(img, demo.colours, demo.backgrounds)
        results.append(
            {
                "prompt": prompt,
                "colour": got.colour,
                "shape": got.shape,
                "colour_ok": got.colour == want.colour,
                "shape_ok": got.shape == want.shape,
            }
        )
    n = len(results)
    return {
        "probe_prompts": n,
        "colour_agreement": round(sum(r["colour_ok"] for r in results) / n, 4) if n else None,
        "shape_agreement": round(sum(r["shape_ok"] for r in results) / n, 4) if n else None,
        "colour_chance": round(1 / len(demo.colours), 4),
        "shape_chance": round(1 / len(demo.shapes), 4),
        "per_prompt": results,
    }


def sample_categories(pipe, cfg: Eval) -> list[tuple[str, str, np.ndarray]]:
    """``(category, prompt, image)`` for every eval prompt, each category with its own steps/guidance."""
    out = []
    for category, prompts in cfg.prompts.items():
        steps, guidance = cfg.settings(category)
        images = generate(
            pipe,
            prompts,
            negative_prompt=cfg.negative_prompt,
            steps=steps,
            guidance_scale=guidance,
            seeds=[cfg.seed + i for i in range(len(prompts))],
            batch_size=cfg.batch_size,
        )
        out += [(category, prompt, img) for prompt, img in zip(prompts, images, strict=True)]
    return out


def run(cfg: Eval, demo: DemoData, models_dir: Path, checkpoint_dir: Path, out_dir: Path) -> dict:
    """Sample ``cfg.prompts`` with EMA weights, write the grid, strips and images; return metrics."""
    from stages.eval_metrics import image_metrics

    pipe = load_pipeline(models_dir, checkpoint_dir, use_ema=True)
    samples = sample_categories(pipe, cfg)
    categories, prompts, images = (list(x) for x in zip(*samples, strict=True))
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    for i, img in enumerate(images):
        Image.fromarray(img).save(out_dir / "images" / f"{i:02d}.png")
    captioned_grid(images, prompts, cfg.columns).save(out_dir / "grid.png")
    (out_dir / STRIPS).mkdir(exist_ok=True)
    for category, texts in cfg.prompts.items():
        row = [img for c, img in zip(categories, images, strict=True) if c == category]
        captioned_grid(row, texts, len(texts)).save(out_dir / STRIPS / f"{category}.png")
    agreement = probe_agreement(images, prompts, demo)
    (out_dir / "probe.json").write_text(json.dumps(agreement, indent=2) + "\n")
    metrics = {k: v for k, v in agreement.items() if k != "per_prompt"}
    metrics.update(
        {
            "images": len(images),
            "categories": len(cfg.prompts),
            "image_size": int(images[0].shape[0]),
            "checkpoint_hash": pipe.checkpoint_hash,
        }
    )
    fid = cfg.fid
    metrics.update(
        image_metrics(
            images,
            prompts,
            categories,
            cfg.clip_model_path,
            fid.inception_path,
            fid.reference_dir,
            fid.max_reference_images,
        )
    )
    return metrics


def _run_stage(params: Params, phase: str) -> dict:
    out_dir = Path(params.paths.eval) / phase
    metrics = run(params.eval, params.demo, Path(params.paths.models), Path(params.paths.checkpoints) / phase, out_dir)
    from stages.tracking import stage_run

    with stage_run(params.tracking, phase, "eval_grid", params.eval.model_dump()) as mlflow:
        mlflow.log_metrics({k: v for k, v in metrics.items() if isinstance(v, int | float)})
        mlflow.log_artifact(str(out_dir / "grid.png"))
        mlflow.log_artifact(str(out_dir / "probe.json"))
        mlflow.log_artifacts(str(out_dir / STRIPS), artifact_path=STRIPS)
        mlflow.set_tag("grid", str((out_dir / "grid.png").resolve()))
    log.info("eval grid: %s", (out_dir / "grid.png").resolve())
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.eval_grid --params params.yaml --item <phase>``."""
    stage_cli("eval_grid", _run_stage, argv=argv)


if __name__ == "__main__":
    main()
