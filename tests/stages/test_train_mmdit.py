"""The MM-DiT family through the stages (issue 56): a tiny SD3Transformer2DModel workspace trains, resumes
bit-identically after a SIGKILL, trains on 2 ranks like 1 process with twice the batch, exports a folder that
``StableDiffusion3Pipeline`` samples pixel for pixel like ``sdforge generate``, and trains a LoRA phase whose
file ``load_lora_weights`` reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from sdforge.eval.export import export_pipeline
from sdforge.eval.sampling import generate, load_pipeline
from tests.fixtures.training import (
    DDP_MAX_ABS_DIFF,
    assert_kill_resume_matches,
    build_workspace,
    train,
    untrained_clone,
    weights,
)

KILL_AT = 4
PROMPTS = ["a red circle on a white background", "a green square on a black background"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The tiny MM-DiT workspace with phase 1 trained uninterrupted (with per-encoder caption dropout)."""
    root = tmp_path_factory.mktemp("mmdit-straight")
    params = build_workspace(root, family="mmdit")
    data = yaml.safe_load(params.read_text())
    data["phases"]["phase1"]["caption_dropout"] = {"text_encoder": 0.3, "text_encoder_2": 0.3, "pooled": 0.1}
    params.write_text(yaml.safe_dump(data))
    done = train(params, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def test_the_scratch_denoiser_is_an_mm_dit_and_training_moves_it(straight):
    config = json.loads((straight / "checkpoints/phase1/unet_ema/config.json").read_text())
    assert config["_class_name"] == "SD3Transformer2DModel" and config["qk_norm"] == "rms_norm"
    before, after = weights(straight, "scratch", "unet"), weights(straight, "phase1", "unet")
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert moved > 1e-4
    metrics = json.loads((straight / "metrics/train/phase1.json").read_text())
    assert metrics["steps"] == 6 and np.isfinite(metrics["final_loss"])


def test_sigkill_then_resume_is_bit_identical(straight, tmp_path):
    assert_kill_resume_matches(straight, tmp_path, "phase1", KILL_AT)


@pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it after `make test`)
def test_two_ranks_train_like_one_process_with_double_batch(straight, tmp_path):
    params = untrained_clone(straight, tmp_path)
    data = yaml.safe_load(params.read_text())
    data["train"]["nproc_per_node"] = 2
    data["phases"]["phase1"]["batch_size"] = 4
    params.write_text(yaml.safe_dump(data))
    done = train(params, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    for sub in ("unet", "unet_ema"):
        a, b = weights(tmp_path, "phase1", sub), weights(straight, "phase1", sub)
        diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        assert diff <= DDP_MAX_ABS_DIFF, f"{sub}: 2 ranks differ from 1 process by {diff:.3g}"


def test_the_export_samples_like_generate_pixel_for_pixel(straight, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    models, checkpoint = straight / "models", straight / "checkpoints/phase1"
    metrics = export_pipeline(models, checkpoint, tmp_path / "export")
    assert metrics["pipeline"] == "StableDiffusion3Pipeline"
    assert metrics["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    ours = generate(load_pipeline(models, checkpoint, device="cpu"), PROMPTS, steps=4, guidance_scale=3.0,
                    seeds=[5, 6])  # fmt: skip
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "export", **metrics["load"])
    theirs = pipe(PROMPTS, num_inference_steps=4, guidance_scale=3.0, output_type="np", height=16, width=16,
                  generator=[torch.Generator().manual_seed(s) for s in (5, 6)], **metrics["call"]).images  # fmt: skip
    theirs = (theirs * 255).round().astype(np.uint8)
    assert np.abs(np.stack(ours).astype(int) - theirs.astype(int)).max() == 0


def test_a_lora_phase_trains_and_its_file_loads_with_load_lora_weights(straight, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    params = untrained_clone(straight, tmp_path)
    for trained in ("checkpoints/phase1", "runs/phase1"):  # phase 2 starts from the straight run's phase 1
        (tmp_path / trained).parent.mkdir(parents=True, exist_ok=True)
    import shutil

    shutil.copytree(straight / "checkpoints/phase1", tmp_path / "checkpoints/phase1")
    data = yaml.safe_load(params.read_text())
    data["phases"]["phase2"]["adapter"] = {"rank": 2, "targets": ["attention", "context_attention", "modulation"],
                                           "merge": False, "words": ["red"]}  # the demo's phase 8; both CLIPs' rows
    params.write_text(yaml.safe_dump(data))
    done = train(params, "phase2")
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = tmp_path / "checkpoints/phase2"
    words = sorted(p.name for p in (checkpoint / "adapter_ema").glob("learned_embeds*"))
    assert words == ["learned_embeds.safetensors", "learned_embeds_2.safetensors"]
    metrics = export_pipeline(tmp_path / "models", checkpoint, tmp_path / "export", keep_lora=True)
    pipe = StableDiffusion3Pipeline.from_pretrained(tmp_path / "export", **metrics["load"])
    pipe.load_lora_weights(tmp_path / "export")
    lora = [n for n, _ in pipe.transformer.named_parameters() if "lora_" in n]
    assert lora and all(".attn." in n or ".norm1" in n for n in lora)  # attention and adaLN modulation only
    assert any(".norm1.linear." in n for n in lora) and any(".norm1_context.linear." in n for n in lora)
    ours = generate(load_pipeline(tmp_path / "models", checkpoint, device="cpu"), PROMPTS, steps=3,
                    guidance_scale=3.0, seeds=[1, 2])  # fmt: skip
    theirs = pipe(PROMPTS, num_inference_steps=3, guidance_scale=3.0, output_type="np", height=16, width=16,
                  generator=[torch.Generator().manual_seed(s) for s in (1, 2)], max_sequence_length=0).images
    assert np.abs(np.stack(ours).astype(int) - (theirs * 255).round().astype(int)).max() <= 1


def test_a_phase_the_family_cannot_train_is_refused_by_key(straight, tmp_path):
    from sdforge.config import ConfigError, load_params

    params = untrained_clone(straight, tmp_path)
    data = yaml.safe_load(params.read_text())
    data["phases"]["phase2"]["adapter"] = {"rank": 2, "targets": ["cross_attention"]}
    params.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="phases.phase2.adapter.targets: \\['cross_attention'\\] are not layer"):
        load_params(params)
    data["phases"]["phase2"].pop("adapter")
    data["phases"]["phase2"]["objective"] = "diffusion"
    params.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match="phases.phase2.objective .*mmdit family trains flow_matching"):
        load_params(params)
