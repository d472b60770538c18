"""The ``make demo-controlnet`` source: small shapes of shown combinations anywhere on the canvas, so a shape's place
is the condition's to say; and the tool's workspace params."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import yaml

from sdforge.config import parse_params
from sdforge.demo.corpus import PLACED_DIR, placed_images
from sdforge.demo.shapes import foreground_mask, parse_caption, probe
from tools.demo_controlnet import OVERLAY, PHASE
from tools.tiny_demo import merged

REPO = Path(__file__).resolve().parents[3]


def _params(root: Path, images: int = 60):
    data = merged(yaml.safe_load((REPO / "params.yaml").read_text()), yaml.safe_load(OVERLAY.read_text()))
    data["demo"]["placed"]["images"] = images
    data["paths"] = {k: str(root / v) for k, v in data["paths"].items()}
    return parse_params(data)


def test_placed_shapes_are_small_spread_over_the_canvas_and_captioned_right(tmp_path):
    params = _params(tmp_path)
    demo, folder = params.demo, tmp_path / PLACED_DIR
    assert placed_images(demo, np.random.default_rng(0), folder) == 60
    held = {tuple(h) for h in demo.held_out}
    centres, widths = [], []
    for i in range(60):
        spec = parse_caption((folder / f"{i:05d}.txt").read_text())
        assert (spec.colour, spec.shape, spec.background) not in held and spec.colour in demo.colours
        image = cv2.cvtColor(cv2.imread(str(folder / f"{i:05d}.png")), cv2.COLOR_BGR2RGB)
        mask = foreground_mask(image)
        ys, xs = np.nonzero(mask)
        side = min(image.shape[:2])
        widths.append((xs.max() - xs.min() + 1) / side)
        centres.append(((xs.mean() / image.shape[1]), ys.mean() / image.shape[0]))
        assert probe(image, demo.palette, demo.backgrounds).colour == spec.colour
    lo, hi = demo.placed.half_size
    assert 2 * lo - 0.1 <= min(widths) and max(widths) <= 2 * hi + 0.1  # small: 24-60 % of the shorter side
    spread = np.std(np.asarray(centres), axis=0)
    assert (spread > 0.1).all()  # anywhere: the corpus' own shapes sit within a few pixels of the centre


def test_the_workspace_params_add_the_source_its_conditions_and_the_controlnet_phase(tmp_path):
    params = _params(tmp_path, images=504)
    phase = params.phases[PHASE]
    assert phase.init_from == "phase7" and phase.mix == {"placed": 1.0} and phase.controlnet.condition == "canny"
    assert params.conditions.kinds == ["canny"] and params.sources["placed"].kind == "local"
    assert phase.samples + params.train.held_out == params.demo.placed.images == 504
    assert params.eval.control_samples <= params.train.held_out  # scored on held-out samples only
