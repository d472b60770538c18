"""``sdforge.eval.export``: a diffusers folder that ``StableDiffusionPipeline.from_pretrained`` loads and that
reproduces our sampler's images exactly; registration in the MLflow model registry (sqlite)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from sdforge.config import Tracking
from sdforge.eval.export import MODEL_ARTIFACT, export_pipeline, register
from sdforge.eval.sampling import generate, load_pipeline
from tests.fixtures.eval_workspace import make_workspace

PROMPTS = ["a red circle on a white background", "a blue square on a black background"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    models, ckpt = make_workspace(root)
    metrics = export_pipeline(models, ckpt, root / "sd")
    return models, ckpt, root / "sd", metrics


def test_folder_layout_ema_unet_ddim_without_clamp_and_no_safety_checker(exported):
    _, ckpt, out, metrics = exported
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline" and index["requires_safety_checker"] is False
    assert index["safety_checker"] == [None, None] and index["scheduler"] == ["diffusers", "DDIMScheduler"]
    sched = json.loads((out / "scheduler/scheduler_config.json").read_text())
    assert sched["clip_sample"] is False and sched["prediction_type"] == "v_prediction"
    assert sched["rescale_betas_zero_snr"] is True and sched["timestep_spacing"] == "trailing"
    assert (sched["beta_start"], sched["beta_end"], sched["beta_schedule"]) == (0.00085, 0.012, "scaled_linear")
    assert not list(out.rglob("*.bin")) and len(list(out.rglob("*.safetensors"))) == 3
    exported_unet = load_file(out / "unet/diffusion_pytorch_model.safetensors")
    ema = load_file(ckpt / "unet_ema/diffusion_pytorch_model.safetensors")
    assert all(torch.equal(exported_unet[k], ema[k]) for k in ema)
    assert metrics["weights"] == "ema" and metrics["image_size"] == 16


def test_from_pretrained_reproduces_our_sampler_exactly(exported):
    from diffusers import StableDiffusionPipeline

    models, ckpt, out, _ = exported
    ours = np.stack(
        generate(load_pipeline(models, ckpt, device="cpu"), PROMPTS, negative_prompt="blurry", steps=4,
                 guidance_scale=3.0, seeds=[7, 8])
    )  # fmt: skip
    sd = StableDiffusionPipeline.from_pretrained(out)
    sd.set_progress_bar_config(disable=True)
    theirs = sd(
        PROMPTS,
        negative_prompt=["blurry"] * 2,
        num_inference_steps=4,
        guidance_scale=3.0,
        generator=[torch.Generator().manual_seed(s) for s in (7, 8)],  # CPU generators, one per image, like ours
        output_type="np",
    ).images
    theirs = (theirs * 255).round().astype(np.uint8)
    assert ours.std() > 10  # not a blank image
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() == 0  # measured: identical pixels


def test_register_creates_a_model_version_pointing_at_the_folder(exported, tmp_path, monkeypatch):
    import mlflow

    _, _, out, metrics = exported
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    got = register(out, "sdforge-demo", Tracking(mlflow_uri=uri), metrics)
    assert got["model_version"] == 1
    client = mlflow.MlflowClient(tracking_uri=uri)
    version = client.get_model_version("sdforge-demo", "1")
    assert version.run_id == got["run_id"] and version.source.endswith(f"/{MODEL_ARTIFACT}")
    assert version.tags["checkpoint_hash"] == metrics["checkpoint_hash"]
    names = {a.path for a in client.list_artifacts(got["run_id"], MODEL_ARTIFACT)}
    assert f"{MODEL_ARTIFACT}/model_index.json" in names and f"{MODEL_ARTIFACT}/unet" in names


def test_a_non_square_image_from_our_sampler_equals_the_exported_pipelines(exported):
    from diffusers import StableDiffusionPipeline

    models, ckpt, out, _ = exported
    width, height = 24, 16  # latents 12×8; the export's pipeline checks sides only against 8
    ours = np.stack(
        generate(load_pipeline(models, ckpt, device="cpu"), PROMPTS[:1], steps=3, guidance_scale=3.0, seeds=[5],
                 width=width, height=height)
    )  # fmt: skip
    sd = StableDiffusionPipeline.from_pretrained(out)
    sd.set_progress_bar_config(disable=True)
    theirs = sd(PROMPTS[:1], negative_prompt=[""], num_inference_steps=3, guidance_scale=3.0, width=width,
                height=height, generator=[torch.Generator().manual_seed(5)], output_type="np").images  # fmt: skip
    theirs = (theirs * 255).round().astype(np.uint8)
    assert ours.shape == theirs.shape == (1, height, width, 3)
    assert ours.std() > 10 and np.abs(ours.astype(int) - theirs.astype(int)).max() == 0


def test_a_side_that_is_not_a_multiple_of_the_models_is_refused(exported):
    models, ckpt, _, _ = exported
    pipe = load_pipeline(models, ckpt, device="cpu")
    with pytest.raises(ValueError, match="multiples of 4 px"):
        generate(pipe, PROMPTS[:1], steps=1, guidance_scale=1.0, seeds=[0], width=18, height=16)
