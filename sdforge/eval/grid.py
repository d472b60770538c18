"""Eval grids: sample every eval prompt per category, caption the images in a grid, probe the demo's shapes.

Used by the ``eval_grid`` stage and by training's validation images (:mod:`sdforge.training.validation`).
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from sdforge.config import DemoData, Eval
from sdforge.demo.shapes import parse_caption, probe, render_spec
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


def _share(results: list[dict], key: str) -> float | None:
    return round(sum(r[key] for r in results) / len(results), 4) if results else None


def probe_agreement(images: list[np.ndarray], prompts: list[str], demo: DemoData) -> dict:
    """Colour and shape agreement of the demo probe with each demo prompt — over all of them, and apart for
    the combinations the corpus shows (``_seen``) and those it holds out (``_held_out``); chance baselines."""
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
                "held_out": demo.is_held_out(want.colour, want.shape, want.background),
                "colour": got.colour,
                "shape": got.shape,
                "colour_ok": got.colour == want.colour,
                "shape_ok": got.shape == want.shape,
            }
        )
    seen = [r for r in results if not r["held_out"]]
    held_out = [r for r in results if r["held_out"]]
    return {
        "probe_prompts": len(results),
        "probe_prompts_seen": len(seen),
        "probe_prompts_held_out": len(held_out),
        "colour_agreement": _share(results, "colour_ok"),
        "shape_agreement": _share(results, "shape_ok"),
        "colour_agreement_seen": _share(seen, "colour_ok"),
        "shape_agreement_seen": _share(seen, "shape_ok"),
        "colour_agreement_held_out": _share(held_out, "colour_ok"),
        "shape_agreement_held_out": _share(held_out, "shape_ok"),
        # full scale has no demo vocabulary (demo.enabled: false): no probe, no chance level
        "colour_chance": round(1 / len(demo.colours), 4) if demo.colours else None,
        "shape_chance": round(1 / len(demo.shapes), 4) if demo.shapes else None,
        "per_prompt": results,
    }


TRUTH_RENDERS = 8
"""Ground-truth renders per eval prompt that :func:`probe_truth` scores (position and size jitter)."""


def probe_truth(prompts: list[str], demo: DemoData, size: int, seed: int = 0) -> dict:
    """The probe's own accuracy on the demo's renders of every demo prompt (``TRUTH_RENDERS`` each, drawn at
    ``demo.image_size`` and resized to ``size`` with INTER_AREA as the fetch does): a probe that misreads the
    truth would make the agreement figures meaningless, so it must score 1.0 here."""
    rng = np.random.default_rng(seed)
    colour_ok = shape_ok = total = 0
    for prompt in prompts:
        try:
            want = parse_caption(prompt)
        except ValueError:
            continue
        for _ in range(TRUTH_RENDERS):
            img = render_spec(demo, want, rng, size)
            got = probe(img, demo.colours, demo.backgrounds)
            colour_ok += got.colour == want.colour
            shape_ok += got.shape == want.shape
            total += 1
    return {
        "probe_truth_images": total,
        "probe_truth_colour": round(colour_ok / total, 4) if total else None,
        "probe_truth_shape": round(shape_ok / total, 4) if total else None,
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
