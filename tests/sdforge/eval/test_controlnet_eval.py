"""A ControlNet phase's eval (:mod:`sdforge.eval.control`): its held-out samples with their own captions and
conditions, drawn with and without the ControlNet, scored by the edge F1 of ControlNet++, the probe and the
placement IoU; every figure is re-derived here from the images the stage wrote."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from model.latents import encode_latents, images_to_tensor
from model.sampler import decode_to_uint8
from sdforge.config import load_params
from sdforge.control.edges import canny_edges, edge_f1, filled_outline, mask_iou
from sdforge.demo.shapes import foreground_mask, parse_caption, render_spec
from sdforge.eval.control import HeldOutControl, held_out_controls
from sdforge.eval.grid import captioned_grid, probe_agreement
from sdforge.eval.sampling import generate, load_pipeline
from sdforge.io import InputError
from sdforge.latents.loader import LatentIndexDataset
from stages import eval_grid
from tests.fixtures.eval_workspace import make_workspace, write_controlnet_phase, write_params
from tests.fixtures.training import SAMPLES, build_workspace, controlnet_params, write_conditions

CAPTIONS = ["a red circle on a white background", "a blue square on a black background", "a cat photo"]
THRESHOLDS = {"low_threshold": 100, "high_threshold": 200}


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """The eval grid of a ControlNet phase on the 16-px eval workspace, under three held-out conditions (two demo
    shapes rendered at 16 px, one not a demo caption)."""
    root = tmp_path_factory.mktemp("cn-eval")
    models, base = make_workspace(root)
    ckpt = root / "checkpoints" / "phase2"
    write_controlnet_phase(base, ckpt)
    params = load_params(write_params(root, models, ckpt.parent, prompts={"shapes": CAPTIONS[:1]}))
    rng = np.random.default_rng(3)
    vae = load_pipeline(models, base).vae
    controls = []
    for i, caption in enumerate(CAPTIONS):
        spec = parse_caption(CAPTIONS[i % 2])
        image = render_spec(params.demo, spec, rng, pixels=16)
        latent = encode_latents(vae, images_to_tensor([image]))[0] if i != 1 else None  # the second: none read
        controls.append(HeldOutControl("laion", f"{i:04d}", caption, canny_edges(image, **THRESHOLDS), latent))
    out = root / "eval" / "phase2"
    metrics = eval_grid.run(params.eval, params.demo, models, ckpt, out, control=(controls, THRESHOLDS))
    return root, params, models, base, ckpt, out, controls, metrics


def test_every_figure_is_the_images_own(evaluated):
    _, params, _, _, _, out, controls, metrics = evaluated
    record = json.loads((out / "controlnet.json").read_text())
    rows = record.pop("per_sample")
    assert record == {k: v for k, v in metrics.items() if k.startswith("controlnet.")}
    assert metrics["controlnet.samples"] == 3 and [r["caption"] for r in rows] == CAPTIONS
    f1, iou = {"": [], "_base": []}, {"": [], "_base": []}
    for i, (control, row) in enumerate(zip(controls, rows, strict=True)):
        condition = np.asarray(Image.open(out / "controlnet" / f"{i:02d}_condition.png"))
        assert np.array_equal(condition[..., 0] > 127, control.edges)
        for suffix, name in (("", "controlnet"), ("_base", "base")):
            drawn = np.asarray(Image.open(out / "controlnet" / f"{i:02d}_{name}.png"))
            f1[suffix].append(edge_f1(control.edges, canny_edges(drawn, **THRESHOLDS)))
            assert row[f"canny_f1{suffix}"] == pytest.approx(f1[suffix][-1], abs=1e-6)
            if i < 2:  # demo captions only
                iou[suffix].append(mask_iou(foreground_mask(drawn), filled_outline(control.edges)))
                assert row[f"placement_iou{suffix}"] == pytest.approx(iou[suffix][-1], abs=1e-6)
            else:
                assert f"placement_iou{suffix}" not in row
    for suffix in ("", "_base"):
        assert metrics[f"controlnet.canny_f1{suffix}"] == pytest.approx(np.mean(f1[suffix]), abs=1e-6)
        assert metrics[f"controlnet.placement_iou{suffix}"] == pytest.approx(np.median(iou[suffix]), abs=1e-6)
    assert metrics["controlnet.shape_agreement"] in (0.0, 0.5, 1.0)  # over the two demo captions


def test_the_decoded_figures_are_the_probe_on_the_samples_own_latents(evaluated):
    _, params, models, base, _, out, controls, metrics = evaluated
    vae = load_pipeline(models, base).vae
    assert not (out / "controlnet" / "01_decoded.png").exists()  # its latent was not read
    decoded = {}
    for i in (0, 2):
        decoded[i] = np.asarray(Image.open(out / "controlnet" / f"{i:02d}_decoded.png"))
        assert np.array_equal(decoded[i], decode_to_uint8(vae, controls[i].latent[None])[0].numpy())
    probe = probe_agreement([decoded[0], decoded[2]], [CAPTIONS[0], CAPTIONS[2]], params.demo)  # one demo caption
    assert probe["probe_prompts"] == 1
    for what in ("colour_agreement", "shape_agreement"):
        assert metrics[f"controlnet.{what}_decoded"] == probe[what] and probe[what] in (0.0, 1.0)


def test_the_base_images_are_the_base_phases_and_the_controlled_ones_its_controlnets(evaluated):
    _, params, models, base, ckpt, out, controls, _ = evaluated
    cfg = params.eval
    kwargs = {"negative_prompt": cfg.negative_prompt, "steps": cfg.steps, "guidance_scale": cfg.guidance_scale,
              "seeds": [cfg.seed + 1], "width": 16, "height": 16}  # fmt: skip
    plain = generate(load_pipeline(models, base), [CAPTIONS[1]], **kwargs)[0]
    assert np.array_equal(np.asarray(Image.open(out / "controlnet/01_base.png")), plain)
    condition = np.repeat((controls[1].edges * 255).astype(np.uint8)[..., None], 3, axis=2)
    steered = generate(load_pipeline(models, ckpt), [CAPTIONS[1]], control_images=[condition], **kwargs)[0]
    assert np.array_equal(np.asarray(Image.open(out / "controlnet/01_controlnet.png")), steered)
    assert not np.array_equal(steered, plain)
    rows = json.loads((out / "controlnet.json").read_text())["per_sample"]
    cells, captions = [], []  # the strip: per sample, its condition, the ControlNet's image and the base's
    for i, row in enumerate(rows):
        names = ("condition", "controlnet", "base")
        cells += [np.asarray(Image.open(out / f"controlnet/{i:02d}_{n}.png")) for n in names]
        captions += ["condition", f"F1 {row['canny_f1']:.2f}: {row['caption']}", f"base F1 {row['canny_f1_base']:.2f}"]
    want = np.asarray(captioned_grid(cells, captions, 3))
    assert np.array_equal(np.asarray(Image.open(out / "strips" / "controlnet.png")), want)


def test_held_out_controls_are_the_held_out_samples_conditions_passing_over_missing_ones(tmp_path):
    params_file = build_workspace(tmp_path, held_out=8)
    controlnet_params(params_file)
    params = load_params(params_file)
    held = Path(params.paths.mixes) / "phase2.held_out.parquet"
    keys = pq.read_table(held, columns=["key"]).column("key").to_pylist()
    write_conditions(params_file, missing_rows=(int(keys[1]),))
    controls = held_out_controls(params, "phase2", 3)
    assert [c.key for c in controls] == [keys[0], keys[2], keys[3]]  # the second has no condition
    drawn = np.random.default_rng(0).random((SAMPLES, 64 * 64)) < 0.2  # the fixture's maps (seed 0)
    data = LatentIndexDataset(held, Path(params.paths.latents), params.phase_resolution("phase2"))
    for position, control in zip((0, 2, 3), controls, strict=True):
        assert control.caption == "c" and np.array_equal(control.edges.reshape(-1), drawn[int(control.key)])
        assert torch.equal(control.latent, data.gather(np.array([position]))[0][0])  # its own stored latent
    held.rename(held.with_suffix(".gone"))
    with pytest.raises(InputError, match="set train.held_out > 0"):
        held_out_controls(params, "phase2", 3)
