"""A tiny demo-format workspace for the sampling tests: ``models/`` (tokenizer, text encoder, VAE,
zero-SNR v-prediction scheduler) and a phase checkpoint whose ``unet_ema`` and ``unet`` differ.

Written with ``save_pretrained`` like ``prepare_models`` and ``train`` write them, 16 px images,
a few seconds to build on a CPU.
"""

from __future__ import annotations

from pathlib import Path

import torch
import yaml
from diffusers import UNet2DConditionModel

from model.builders import build_tiny_text_encoder, build_tiny_vae, noise_scheduler
from stages.prepare_models import write_demo_tokenizer

REPO = Path(__file__).resolve().parents[2]
WORDS = "a on background red green blue circle square triangle white black blurry cat photo".split()
MAX_TOKENS = 16
DEMO_NOISE = {
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "prediction_type": "v_prediction",
    "rescale_betas_zero_snr": True,
}


def write_tokenizer(out: Path):
    """The demo-style CLIP tokenizer over :data:`WORDS` (every word one token)."""
    return write_demo_tokenizer(WORDS, out, MAX_TOKENS)


def tiny_unet(seed: int) -> UNet2DConditionModel:
    """A seeded 8×8-latent UNet with cross-attention to 16-wide text states."""
    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(16, 32),
        layers_per_block=1,
        norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
    ).eval()


def make_workspace(root: Path) -> tuple[Path, Path]:
    """Write ``root/models`` and ``root/checkpoints/phase1`` (EMA ≠ live weights); return both dirs."""
    models, ckpt = root / "models", root / "checkpoints" / "phase1"
    tokenizer = write_tokenizer(models / "tokenizer")
    build_tiny_text_encoder(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=MAX_TOKENS,
        seed=0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    ).save_pretrained(models / "text_encoder")
    vae = build_tiny_vae([8, 16], layers_per_block=1, latent_channels=4, seed=0)
    vae.register_to_config(scaling_factor=0.7)  # not 1.0: exercises the latent scaling on both sides
    vae.save_pretrained(models / "vae")
    noise_scheduler(DEMO_NOISE).save_pretrained(models / "scheduler")
    tiny_unet(1).save_pretrained(ckpt / "unet_ema")
    tiny_unet(2).save_pretrained(ckpt / "unet")
    return models, ckpt


def write_params(root: Path, models: Path, checkpoints: Path, **eval_overrides) -> Path:
    """The repo's ``params.yaml`` with ``paths`` pointing into ``root`` and tiny eval settings."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["paths"].update(models=str(models), checkpoints=str(checkpoints), eval=str(root / "eval"))
    params["paths"]["metrics"] = str(root / "metrics")
    params["eval"].update(steps=3, guidance_scale=3.0, batch_size=4, **eval_overrides)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path
