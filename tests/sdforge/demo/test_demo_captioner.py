"""The demo captioner (issue 26): a tiny BLIP trained on demo renders writes demo captions whose colour and shape
words are right above chance, trains the same weights for the same seed, and never sees a held-out combination.

A short run (300 steps of a 1-layer, width-64 model: ~6 s on 2 cores) learns colours and backgrounds, shapes above
chance; shapes of held-out combinations need the longer run ``bench.demo_captioner`` measures. Values only; no timing
is asserted."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from sdforge.captions.captioner import generate, load_captioner
from sdforge.config import FetchSettings, load_params
from sdforge.demo.captioner import (
    OFF_PALETTE_MARGIN,
    PROMPT,
    SETTINGS,
    TrainingRenders,
    caption_accuracy,
    eval_renders,
    fetched_render,
    score_captions,
    train_demo_captioner,
)
from sdforge.demo.corpus import encode_image
from sdforge.demo.shapes import ShapeSpec, parse_caption, probe, render, shown_specs
from sdforge.ingest.image_convert import convert

REPO_PARAMS = Path(__file__).resolve().parents[3] / "params.yaml"
SHORT = {"steps": 300, "batch_size": 32, "lr": 3e-3, "width": 64, "layers": 1, "image_size": 32}
LOSS_FACTOR = 10.0
"""The short run's loss falls at least this many times (first step → mean of the last tenth): ~3 → ~0.1
(30-32 times for seeds 0-2)."""
COLOUR_BAR = 0.6
"""Colour accuracy on fresh renders of shown combinations the short run reaches (chance: 1/5; seeds 0-2: 1.0)."""
SHAPE_BAR = 0.5
"""Its shape accuracy there (chance: 1/3; seeds 0-2: 0.69-0.75)."""


@pytest.fixture(scope="module")
def demo():
    return load_params(REPO_PARAMS).demo


@pytest.fixture(scope="module")
def trained(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo-captioner")
    return out, train_demo_captioner(out, demo, seed=0, **SHORT)


def test_a_short_run_lowers_the_loss_and_reads_colours_and_shapes_back_above_chance(demo, trained):
    out, metrics = trained
    assert metrics["steps"] == 300 and metrics["params"] > 0 and metrics["words"] == 13
    assert metrics["loss_final"] * LOSS_FACTOR < metrics["loss_first"]
    scores = caption_accuracy(out, demo, n=90, seed=1)
    assert scores["n"] == 90 and scores["n_held_out"] == 18  # 6 of the 30 combinations, in balanced rounds
    assert 1 / len(demo.colours) < COLOUR_BAR <= scores["colour_accuracy"]
    assert 1 / len(demo.shapes) < SHAPE_BAR <= scores["shape_accuracy"]
    assert scores["background_accuracy"] >= 0.9 and scores["well_formed"] >= 0.9
    assert len(scores["examples"]) == 8 and all(isinstance(t, str) for _, t in scores["examples"])


def test_unprompted_generation_writes_demo_captions(demo, trained):
    processor, model = load_captioner(str(trained[0]))
    images, specs = eval_renders(demo, 12, seed=2)
    texts = generate(processor, model, images, PROMPT, SETTINGS)
    read = [parse_caption(t) for t in texts]  # raises on a caption not of the demo form
    assert sum(r.colour == s.colour for r, s in zip(read, specs, strict=True)) >= 8


def test_the_same_seed_trains_the_same_weights(demo, tmp_path):
    tiny = {**SHORT, "steps": 3, "batch_size": 8, "width": 32}
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        train_demo_captioner(tmp_path / name, demo, seed=seed, **tiny)
    weights = {name: (tmp_path / name / "model.safetensors").read_bytes() for name in "abc"}
    assert weights["a"] == weights["b"] != weights["c"]


def test_training_renders_show_only_shown_combinations_as_fetched(demo):
    assert demo.held_out and demo.concept is not None
    renders = TrainingRenders(demo, seed=0, off_palette=0.25)
    batches = [renders.batch(32) for _ in range(12)]  # 384 renders: 12 rounds of the 24 shown combinations
    known = [(img, spec) for b in batches for img, spec, k in zip(b.images, b.specs, b.colour_known, strict=True) if k]
    stand_ins = [(img, rgb) for b in batches for img, k, rgb in zip(b.images, b.colour_known, b.colours, strict=True)
                 if not k]  # fmt: skip
    assert len(known) == 12 * 24 and len(stand_ins) == 12 * 8
    specs = [s for b in batches for s in b.specs]
    assert not any(demo.is_held_out(s.colour, s.shape, s.background) for s in specs)
    assert {s for _, s in known} == set(shown_specs(list(demo.colours), demo.shapes, list(demo.backgrounds),
                                                    demo.held_out))  # fmt: skip
    assert all(probe(img, demo.palette, demo.backgrounds).colour == s.colour for img, s in known)
    named = np.array([*demo.palette.values(), *demo.backgrounds.values()], float)  # the concept colour included
    assert all(np.sqrt(((named - rgb) ** 2).sum(1)).min() >= OFF_PALETTE_MARGIN for _, rgb in stand_ins)
    sizes = {img.shape[:2] for b in batches for img in b.images}
    assert sizes == {(32, 32), (32, 48), (48, 32)}  # the canvases, 32 px on the shorter side as fetched


def test_a_render_is_what_the_fetch_stores_from_the_corpus_image(demo):
    fetch = FetchSettings(image_size=32, resize_mode="keep_ratio", encode_quality=95)
    spec = ShapeSpec("triangle", "purple", "white")
    for canvas in demo.canvas_sizes:
        ours = fetched_render(demo, spec, canvas, np.random.default_rng(7))
        corpus = render(spec, canvas, demo.colours["purple"], demo.backgrounds["white"], np.random.default_rng(7),
                        demo.half_size)  # fmt: skip
        jpeg, size, _ = convert(encode_image(corpus, ".png"), fetch)
        stored = cv2.cvtColor(cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        assert min(size) == 32 and ours.shape == stored.shape and np.array_equal(ours, stored)


def test_a_malformed_caption_counts_wrong_on_every_field(demo):
    specs = [
        ShapeSpec("circle", "red", "white"),
        ShapeSpec("square", "red", "black"),
        ShapeSpec("circle", "red", "black"),
    ]
    generated = ["a red circle on a white background", "a red square on a black background", "red circle black"]
    scores = score_captions(demo, specs, generated)
    assert scores["n"] == 3 and scores["n_held_out"] == 1  # red square on black is held out
    assert scores["colour_accuracy"] == scores["shape_accuracy"] == scores["background_accuracy"] == 0.5
    assert scores["held_out_colour_accuracy"] == scores["held_out_shape_accuracy"] == 1.0
    assert scores["well_formed"] == pytest.approx(2 / 3) and scores["exact"] == pytest.approx(2 / 3)
    file_names = score_captions(demo, specs, ["DSC_01000.JPG", "DSC_01001.JPG", "DSC_01002.JPG"])
    assert file_names["colour_accuracy"] == file_names["shape_accuracy"] == file_names["held_out_colour_accuracy"] == 0
