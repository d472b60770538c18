"""The ``make demo-controlnet`` source: small shapes of shown combinations anywhere on the canvas, so a shape's place
is the condition's to say; and the tool's workspace params."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import yaml

from sdforge.config import parse_params
from sdforge.demo.corpus import PLACED_DIR, placed_images
from sdforge.demo.models import render_demo, render_sizes
from sdforge.demo.shapes import foreground_mask, parse_caption, probe, render_spec, shown_specs
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


def test_the_demo_vae_also_trains_on_placed_sizes_and_the_plain_demo_renders_what_it_did(tmp_path):
    params = _params(tmp_path)
    demo, plain = params.demo, params.demo.model_copy(update={"placed": None})
    images, specs = render_demo(demo, 32, 40, np.random.default_rng(5))
    widths = [np.ptp(np.nonzero(foreground_mask(image))[1]) + 1 for image in images]
    small, large = widths[1::2], widths[0::2]  # every other render at placed.half_size (max 0.3 of 48 px at 32 px)
    assert max(small) < min(large) and max(small) <= 2 * 0.3 * 32 + 2
    assert render_sizes(demo) == [demo.half_size, demo.placed.half_size] and render_sizes(plain) == [demo.half_size]
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    again, plain_specs = render_demo(plain, 32, 6, rng_a)  # without a placed source: one size, as before
    shown = shown_specs(list(demo.palette), list(demo.shapes), list(demo.backgrounds), demo.held_out)
    before = [shown[int(i)] for i in rng_b.integers(0, len(shown), size=6)]
    assert plain_specs == before
    assert all(np.array_equal(a, render_spec(plain, s, rng_b, 32)) for a, s in zip(again, before, strict=True))


def test_the_overlay_trains_its_vae_long_enough_for_small_shapes(tmp_path):
    assert _params(tmp_path).models.vae_build.train_steps == 2400  # docs/CONTROL.md "The VAE's ceiling"
