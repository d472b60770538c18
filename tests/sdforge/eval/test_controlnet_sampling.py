"""A ControlNet phase's checkpoint sampled (``generate`` under conditioning images) and exported: the base pipeline
plus ``controlnet/``, which ``StableDiffusionControlNetPipeline`` with ``ControlNetModel.from_pretrained`` loads and
samples to our pixels exactly (docs/CONTROL.md)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sdforge.eval.export import export_pipeline
from sdforge.eval.sampling import generate, load_pipeline
from sdforge.io import InputError
from tests.fixtures.eval_workspace import make_workspace, write_controlnet_phase

PROMPTS = ["a red circle on a white background", "a blue square on a black background"]
SIDE = 16
"""The tiny workspace's image side (8×8 latents, a 2× VAE)."""


def edge_image(seed: int, density: float = 0.2) -> np.ndarray:
    """A random binary edge map as the RGB uint8 image a user passes (white edges on black)."""
    rng = np.random.default_rng(seed)
    edges = rng.random((SIDE, SIDE)) < density
    return np.repeat((edges * 255).astype(np.uint8)[..., None], 3, axis=2)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("controlnet")
    models, base = make_workspace(root)
    ckpt = root / "checkpoints" / "phase2"
    settings = write_controlnet_phase(base, ckpt, scale=0.8)
    return models, base, ckpt, settings


def _draw(pipe, controls, seeds=(7, 8)):
    return np.stack(generate(pipe, PROMPTS, negative_prompt="blurry", steps=4, guidance_scale=3.0,
                             seeds=list(seeds), control_images=controls))  # fmt: skip


def test_each_image_follows_its_own_condition_and_seed(workspace):
    models, _, ckpt, _ = workspace
    pipe = load_pipeline(models, ckpt, device="cpu")
    a, b = edge_image(0), edge_image(1)
    first = _draw(pipe, [a, b])
    assert np.array_equal(first, _draw(pipe, [a, b]))  # deterministic
    swapped = _draw(pipe, [a, a])
    assert np.array_equal(first[0], swapped[0])  # image 0 depends on its own condition only
    assert np.abs(first[1].astype(int) - swapped[1].astype(int)).max() > 0  # another condition, another image


def test_a_controlnet_checkpoint_without_conditions_and_a_plain_one_with_them_are_refused(workspace):
    models, base, ckpt, _ = workspace
    with pytest.raises(ValueError, match="needs one conditioning image per image"):
        _draw(load_pipeline(models, ckpt, device="cpu"), None)
    with pytest.raises(ValueError, match=r"\[1\] are not RGB uint8 of the image size 16x16"):
        _draw(load_pipeline(models, ckpt, device="cpu"), [edge_image(0), edge_image(1)[:8]])
    with pytest.raises(ValueError, match="has no ControlNet"):
        _draw(load_pipeline(models, base, device="cpu"), [edge_image(0), edge_image(1)])


def test_a_missing_controlnet_folder_is_named(workspace, tmp_path):
    import shutil

    models, _, ckpt, _ = workspace
    broken = tmp_path / "phase2"
    shutil.copytree(ckpt, broken)
    shutil.rmtree(broken / "controlnet_ema")
    with pytest.raises(InputError, match="controlnet_ema: no ControlNet weights there"):
        load_pipeline(models, broken, device="cpu")


def test_the_export_with_its_controlnet_draws_our_pixels_in_diffusers_controlnet_pipeline(workspace, tmp_path):
    from diffusers import ControlNetModel, StableDiffusionControlNetPipeline
    from PIL import Image

    models, base, ckpt, settings = workspace
    metrics = export_pipeline(models, ckpt, tmp_path / "sd")
    out = tmp_path / "sd"
    pipeline = "StableDiffusionControlNetPipeline"
    call = {"controlnet_conditioning_scale": 0.8}
    assert metrics["controlnet"] == {**settings, "folder": "controlnet", "pipeline": pipeline, "call": call}
    assert json.loads((out / "model_index.json").read_text())["_class_name"] == "StableDiffusionPipeline"
    controls = [edge_image(0), edge_image(1)]
    ours = _draw(load_pipeline(models, ckpt, device="cpu"), controls)
    cn = ControlNetModel.from_pretrained(out / "controlnet")
    sd = StableDiffusionControlNetPipeline.from_pretrained(out, controlnet=cn, safety_checker=None,
                                                           feature_extractor=None)  # fmt: skip
    sd.set_progress_bar_config(disable=True)
    theirs = sd(PROMPTS, image=[Image.fromarray(c) for c in controls], negative_prompt=["blurry"] * 2,
                num_inference_steps=4, guidance_scale=3.0, controlnet_conditioning_scale=0.8,
                generator=[torch.Generator().manual_seed(s) for s in (7, 8)], output_type="np").images  # fmt: skip
    theirs = (theirs * 255).round().astype(np.uint8)
    assert ours.std() > 10
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() == 0  # identical pixels
    weights = "diffusion_pytorch_model.safetensors"
    exported, base_ema = load_file(out / "unet" / weights), load_file(base / "unet_ema" / weights)
    assert exported.keys() == base_ema.keys() and all(torch.equal(exported[k], base_ema[k]) for k in base_ema)
