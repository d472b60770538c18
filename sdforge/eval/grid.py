"""Eval grids: sample every eval prompt per category, caption the images in a grid, probe the demo's shapes.

Used by the ``eval_grid`` stage and by training's validation images (:mod:`sdforge.training.validation`).
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from sdforge.config import DemoData, Eval
from sdforge.demo.shapes import parse_caption, probe
from sdforge.eval.sampling import generate

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
        # full scale has no demo vocabulary (demo.enabled: false): no probe, no chance level
        "colour_chance": round(1 / len(demo.colours), 4) if demo.colours else None,
        "shape_chance": round(1 / len(demo.shapes), 4) if demo.shapes else None,
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
