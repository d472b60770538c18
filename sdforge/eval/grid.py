"""Eval grids: sample every eval prompt per category (and the first category's first prompts at the extra,
non-square sizes), caption the images in a grid, probe the demo's shapes.

Used by the ``eval_grid`` stage and by training's validation images (:mod:`sdforge.training.validation`).
A consistency-distilled phase (state.json ``distill``) samples every category with its ``distill.sampling_steps``
and guidance 1 (:func:`category_settings`): ``eval.steps`` / ``guidance_scale`` / ``sampling`` are for
many-step samplers with CFG.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageDraw

from model.sampler import pixel_multiple
from sdforge.config import DemoData, Eval
from sdforge.demo.shapes import Size, as_wh, parse_caption, probe, render_spec
from sdforge.eval.sampling import few_step_settings, generate
from sdforge.io import InputError

CELL = 128
"""Pixels the first image's longer side is scaled to in a grid (every image is scaled by that same factor)."""
CAPTION_H = 28
PAD_COLOUR = (128, 128, 128)
"""Fills a cell around an image smaller than the cell (mixed sizes: each cell is as large as the largest)."""


def captioned_grid(
    images: list[np.ndarray],
    captions: list[str],
    columns: int,
    extra: Sequence[tuple[list[np.ndarray], list[str]]] = (),
) -> Image.Image:
    """Images upscaled (nearest), each with its caption under it, in ``columns`` columns; ``extra`` groups of
    ``(images, captions)`` follow, each starting on a new row.

    Every image is scaled by one factor, ``CELL`` / the first image's longer side (a square-only grid: every
    cell ``CELL`` px, as always), and centred in a cell as wide as the widest and as tall as the tallest
    scaled image, padded with ``PAD_COLOUR``."""
    groups = [(list(images), list(captions)), *((list(i), list(c)) for i, c in extra)]
    every = [img for imgs, _ in groups for img in imgs]
    if not every:
        return Image.new("RGB", (columns * CELL, 0), "white")
    scale = CELL / max(every[0].shape[:2])
    sizes = [(max(1, round(img.shape[1] * scale)), max(1, round(img.shape[0] * scale))) for img in every]
    cell_w, cell_h = max(w for w, _ in sizes), max(h for _, h in sizes)
    rows = sum(-(-len(imgs) // columns) for imgs, _ in groups)
    grid = Image.new("RGB", (columns * cell_w, rows * (cell_h + CAPTION_H)), "white")
    draw = ImageDraw.Draw(grid)
    row, k = 0, 0
    for imgs, texts in groups:
        for i, (img, text) in enumerate(zip(imgs, texts, strict=True)):
            (w, h), x, y = sizes[k], (i % columns) * cell_w, (row + i // columns) * (cell_h + CAPTION_H)
            if (w, h) != (cell_w, cell_h):
                grid.paste(PAD_COLOUR, (x, y, x + cell_w, y + cell_h))
            cell = Image.fromarray(img).resize((w, h), Image.NEAREST)
            grid.paste(cell, (x + (cell_w - w) // 2, y + (cell_h - h) // 2))
            words = text.split()
            half = (len(words) + 1) // 2
            draw.text((x + 2, y + cell_h + 1), " ".join(words[:half]), fill="black")
            draw.text((x + 2, y + cell_h + 13), " ".join(words[half:]), fill="black")
            k += 1
        row += -(-len(imgs) // columns)
    return grid


def _share(results: list[dict], key: str) -> float | None:
    return round(sum(r[key] for r in results) / len(results), 4) if results else None


def probe_agreement(images: list[np.ndarray], prompts: list[str], demo: DemoData) -> dict:
    """Colour and shape agreement of the demo probe with each demo prompt — over all of them, and apart for
    the combinations the corpus shows (``_seen``), those it holds out (``_held_out``) and those in the
    concept colour only the concept source shows (``_concept``, when ``demo.concept``; its colour also per background,
    ``colour_agreement_concept_on_<background>``); chance baselines."""
    results = []
    for img, prompt in zip(images, prompts, strict=True):
        try:
            want = parse_caption(prompt)
        except ValueError:
            continue
        got = probe(img, demo.palette, demo.backgrounds)
        results.append(
            {
                "prompt": prompt,
                "held_out": demo.is_held_out(want.colour, want.shape, want.background),
                "concept": demo.is_concept(want.colour),
                "background": want.background,
                "colour": got.colour,
                "shape": got.shape,
                "colour_ok": got.colour == want.colour,
                "shape_ok": got.shape == want.shape,
            }
        )
    concept = [r for r in results if r["concept"]]
    seen = [r for r in results if not r["held_out"] and not r["concept"]]
    held_out = [r for r in results if r["held_out"]]
    groups = {"seen": seen, "held_out": held_out, **({"concept": concept} if demo.concept else {})}
    figures = {"probe_prompts": len(results)}
    figures.update({f"probe_prompts_{name}": len(rows) for name, rows in groups.items()})
    figures.update(colour_agreement=_share(results, "colour_ok"), shape_agreement=_share(results, "shape_ok"))
    for name, rows in groups.items():
        figures.update(
            {f"colour_agreement_{name}": _share(rows, "colour_ok"), f"shape_agreement_{name}": _share(rows, "shape_ok")}
        )
    for background in sorted({r["background"] for r in concept}):  # a new colour may hold on one background only
        rows = [r for r in concept if r["background"] == background]
        figures[f"colour_agreement_concept_on_{background}"] = _share(rows, "colour_ok")
    return {
        **figures,
        # full scale has no demo vocabulary (demo.enabled: false): no probe, no chance level
        "colour_chance": round(1 / len(demo.palette), 4) if demo.colours else None,
        "shape_chance": round(1 / len(demo.shapes), 4) if demo.shapes else None,
        "per_prompt": results,
    }


TRUTH_RENDERS = 8
"""Ground-truth renders per eval prompt that :func:`probe_truth` scores (position and size jitter)."""


def probe_truth(prompts: list[str], demo: DemoData, size: Size, seed: int = 0) -> dict:
    """The probe's own accuracy on the demo's renders of every demo prompt (``TRUTH_RENDERS`` each, drawn at
    ``demo.image_size`` and resized to ``size`` with INTER_AREA as the fetch does; ``size`` may be
    ``(width, height)``: see :func:`sdforge.demo.shapes.render_spec`): a probe that misreads the truth would
    make the agreement figures meaningless, so it must score 1.0 here."""
    rng = np.random.default_rng(seed)
    colour_ok = shape_ok = total = 0
    for prompt in prompts:
        try:
            want = parse_caption(prompt)
        except ValueError:
            continue
        for _ in range(TRUTH_RENDERS):
            img = render_spec(demo, want, rng, size)
            got = probe(img, demo.palette, demo.backgrounds)
            colour_ok += got.colour == want.colour
            shape_ok += got.shape == want.shape
            total += 1
    return {
        "probe_truth_images": total,
        "probe_truth_colour": round(colour_ok / total, 4) if total else None,
        "probe_truth_shape": round(shape_ok / total, 4) if total else None,
    }


def category_settings(pipe, cfg: Eval, category: str) -> tuple[int, float]:
    """``(steps, guidance_scale)`` ``pipe``'s phase samples ``category`` with: the distilled phase's few-step
    settings (:func:`~sdforge.eval.sampling.few_step_settings`) for every category, else ``eval.settings``."""
    return few_step_settings(pipe) or cfg.settings(category)


def sampling_figures(pipe, cfg: Eval) -> dict:
    """What sampling the eval prompts cost: ``unet_calls_per_image`` (steps × 2 with CFG, × 1 without; the mean
    over the prompts), and ``sampling_steps`` / ``guidance_scale`` where one setting covers every category
    (always for a distilled phase)."""
    settings = [category_settings(pipe, cfg, category) for category, texts in cfg.prompts.items() for _ in texts]
    calls = [steps * (2 if guidance > 1 else 1) for steps, guidance in settings]
    figures: dict = {"unet_calls_per_image": round(sum(calls) / len(calls), 2)}
    if len(set(settings)) == 1:
        figures.update(sampling_steps=settings[0][0], guidance_scale=settings[0][1])
    return figures


def sample_categories(pipe, cfg: Eval) -> list[tuple[str, str, np.ndarray]]:
    """``(category, prompt, image)`` for every eval prompt, each category with its own steps/guidance
    (:func:`category_settings`)."""
    out = []
    for category, prompts in cfg.prompts.items():
        images = _sample_category(pipe, cfg, category, prompts)
        out += [(category, prompt, img) for prompt, img in zip(prompts, images, strict=True)]
    return out


def _sample_category(pipe, cfg: Eval, category: str, prompts: list[str], size: Size | None = None) -> list[np.ndarray]:
    """``prompts`` with ``category``'s steps and guidance, prompt ``i`` with seed ``eval.seed + i``, at ``size``
    (default: the UNet's sample size)."""
    steps, guidance = category_settings(pipe, cfg, category)
    width, height = (None, None) if size is None else (int(size[0]), int(size[1]))
    return generate(
        pipe,
        prompts,
        negative_prompt=cfg.negative_prompt,
        steps=steps,
        guidance_scale=guidance,
        seeds=[cfg.seed + i for i in range(len(prompts))],
        batch_size=cfg.batch_size,
        width=width,
        height=height,
    )


def size_name(size: Size) -> str:
    """``<width>x<height>``, as extra-size file names and metric keys spell a size."""
    width, height = as_wh(size)
    return f"{width}x{height}"


def extra_prompts(cfg: Eval) -> tuple[str, list[str]]:
    """The category and prompts sampled at each of ``eval.extra_sizes``: the first ``eval.extra_prompts``
    prompts of the first category (prompt ``i`` with seed ``eval.seed + i``, as its square cell)."""
    category = next(iter(cfg.prompts))
    return category, cfg.prompts[category][: cfg.extra_prompts]


def check_extra_sizes(pipe, cfg: Eval) -> None:
    """An :class:`InputError` naming ``eval.extra_sizes`` if a side is not a multiple of the model's pixel
    multiple (the VAE's downsampling times the UNet's) — before anything is sampled."""
    multiple = pixel_multiple(pipe.unet, pipe.vae)
    bad = [size_name(size) for size in cfg.extra_sizes if size[0] % multiple or size[1] % multiple]
    if bad:
        raise InputError(
            f"eval.extra_sizes: {', '.join(bad)}: width and height must be multiples of {multiple} px for this "
            f"model (its VAE × UNet downsampling); e.g. {multiple * 3}x{multiple * 5}"
        )


def sample_extra_sizes(pipe, cfg: Eval) -> dict[tuple[int, int], list[np.ndarray]]:
    """``(width, height)`` → the :func:`extra_prompts` sampled at that size with their square cells' seeds,
    steps and guidance, for each of ``eval.extra_sizes``."""
    category, prompts = extra_prompts(cfg)
    return {(int(w), int(h)): _sample_category(pipe, cfg, category, prompts, (w, h)) for w, h in cfg.extra_sizes}


def probe_extra_sizes(extra: dict[tuple[int, int], list[np.ndarray]], prompts: list[str], demo: DemoData) -> dict:
    """Per extra size: ``colour_agreement_<w>x<h>``, ``shape_agreement_<w>x<h>`` (``None`` where no prompt is a
    demo caption), the probe's accuracy on ground-truth renders at that size (``probe_truth_colour_<w>x<h>``,
    ``probe_truth_shape_<w>x<h>``) and, under ``extra_per_prompt``, what it read from each image."""
    out: dict = {"extra_per_prompt": {}}
    for size, images in extra.items():
        name = size_name(size)
        agreement = probe_agreement(images, prompts[: len(images)], demo)
        truth = probe_truth(prompts[: len(images)], demo, size)
        out[f"colour_agreement_{name}"] = agreement["colour_agreement"]
        out[f"shape_agreement_{name}"] = agreement["shape_agreement"]
        out[f"probe_truth_colour_{name}"] = truth["probe_truth_colour"]
        out[f"probe_truth_shape_{name}"] = truth["probe_truth_shape"]
        out["extra_per_prompt"][name] = agreement["per_prompt"]
    return out
