"""The README's picture: a few eval prompts of each category (rows of phases, columns of prompts), from the images
the ``eval_grid`` stages wrote.

    make demo && python -m tools.demo_figure            # → docs/images/demo-phases.png
    python -m tools.demo_figure --phases phase0 phase7 phase8 phase9 --per-category 4 --out my.png

Each cell is ``eval/<phase>/images/NN.png`` (prompt ``NN`` of ``eval.prompts``, categories in file order: the same
seed in every phase), upscaled with nearest-neighbour; the first ``--per-category`` distinct prompts of each
category are shown. A phase whose grid was not sampled (``phases.<p>.eval_grid: false``) or not run yet is an
error naming its folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from PIL import Image, ImageDraw

from sdforge.config import ConfigError, Params, load_params
from sdforge.io import InputError

CELL, LABEL_W, HEADER_H, GAP = 96, 150, 44, 8
PHASE_NOTES = {
    "phase0": "first phase (24 px)",
    "phase7": "end of phases 1-7",
    "phase8": "+ LoRA for 'orange'",
    "phase9": "4 steps (LCM-LoRA)",
}
"""A short note under each of the demo's phases' names (another phase: its ``description`` up to a bracket)."""


def chosen_prompts(params: Params, per_category: int) -> list[tuple[str, int, str]]:
    """``(category, image index, prompt)`` of the first ``per_category`` distinct prompts of every category."""
    chosen, index = [], 0
    for category, prompts in params.eval.prompts.items():
        seen: set[str] = set()
        for prompt in prompts:
            if prompt not in seen and len(seen) < per_category:
                seen.add(prompt)
                chosen.append((category, index, prompt))
            index += 1
    return chosen


def phase_images(eval_dir: Path, phase: str, indices: list[int]) -> list[Image.Image]:
    """The phase's eval images of ``indices``; an :class:`InputError` naming the folder when one is missing."""
    folder = eval_dir / phase / "images"
    missing = [i for i in indices if not (folder / f"{i:02d}.png").is_file()]
    if missing:
        raise InputError(
            f"{folder}: no image {missing[0]:02d}.png — run `make demo` (or `dvc repro eval_grid@{phase}`) first; "
            f"a phase with `eval_grid: false` has no images"
        )
    return [Image.open(folder / f"{i:02d}.png").convert("RGB") for i in indices]


def compose(rows: dict[str, list[Image.Image]], columns: list[tuple[str, str]], notes: dict[str, str]) -> Image.Image:
    """A table: a header of ``(category, prompt)`` per column, a row of images per phase labelled with its name
    and ``notes[phase]``."""
    width = LABEL_W + len(columns) * (CELL + GAP)
    figure = Image.new("RGB", (width, HEADER_H + len(rows) * (CELL + GAP)), "white")
    draw = ImageDraw.Draw(figure)
    for c, (category, prompt) in enumerate(columns):
        x = LABEL_W + c * (CELL + GAP)
        words = prompt.split()
        draw.text((x, 2), category, fill=(110, 110, 110))
        draw.text((x, 16), " ".join(words[:3]), fill="black")
        draw.text((x, 28), " ".join(words[3:]).removesuffix(" background"), fill="black")
    for r, (phase, images) in enumerate(rows.items()):
        y = HEADER_H + r * (CELL + GAP)
        draw.text((4, y + CELL // 2 - 12), phase, fill="black")
        draw.text((4, y + CELL // 2 + 2), notes[phase], fill=(110, 110, 110))
        for c, image in enumerate(images):
            figure.paste(image.resize((CELL, CELL), Image.NEAREST), (LABEL_W + c * (CELL + GAP), y))
    return figure


def build(params: Params, phases: list[str], per_category: int) -> Image.Image:
    """The figure for ``phases`` (rows) × the chosen prompts (columns)."""
    unknown = [p for p in phases if p not in params.phases]
    if unknown:
        raise InputError(f"--phases: {unknown[0]} is not a phase of this params file ({list(params.phases)})")
    chosen = chosen_prompts(params, per_category)
    indices = [i for _, i, _ in chosen]
    rows = {phase: phase_images(Path(params.paths.eval), phase, indices) for phase in phases}
    notes = {p: PHASE_NOTES.get(p) or (params.phases[p].description or "").split("(")[0][:24] for p in phases}
    return compose(rows, [(category, prompt) for category, _, prompt in chosen], notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.demo_figure", description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--phases", nargs="+", default=["phase0", "phase7", "phase8"])
    ap.add_argument("--per-category", type=int, default=3, choices=range(1, 9), metavar="1..8")
    ap.add_argument("--out", default="docs/images/demo-phases.png")
    args = ap.parse_args(argv)
    try:
        figure = build(load_params(args.params), args.phases, args.per_category)
    except (ConfigError, InputError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    figure.save(args.out, optimize=True)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
