"""Validation images during training: the eval sampler on the EMA weights every ``train.validation_every`` steps.

The first ``train.validation_prompts`` eval prompts, with ``eval``'s default steps, guidance,
negative prompt and seeds (``eval.seed + i``), so the images line up with the phase's eval grid.
Sampling draws its noise from its own CPU generators and swaps the EMA weights in and back out
exactly, so a run with validation trains bit-identically to one without.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from stages.config import Params


class Validator:
    """Samples the validation prompts from a :class:`stages.trainer.Trainer`'s EMA weights (main rank)."""

    def __init__(self, params: Params, tr) -> None:
        from diffusers import AutoencoderKL

        from model.sampler import ddim_from_training, encode_prompts, latent_shape_for

        ev = params.eval
        self.every = params.train.validation_every
        self.prompts = ev.all_prompts[: params.train.validation_prompts]
        self.steps, self.guidance, self.seed = ev.steps, ev.guidance_scale, ev.seed
        device = tr.dist.device
        self.vae = AutoencoderKL.from_pretrained(Path(params.paths.models) / "vae").to(device).eval()
        self.ddim = ddim_from_training(dict(tr.scheduler.config))
        self.shape = latent_shape_for(tr.unet, self.vae)
        with torch.no_grad():
            self.cond = encode_prompts(tr.tokenizer, tr.text_encoder, self.prompts, device).float()
            self.uncond = encode_prompts(tr.tokenizer, tr.text_encoder, [ev.negative_prompt], device).float()

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` gets validation images."""
        return self.every > 0 and step % self.every == 0

    def images(self, tr) -> list[np.ndarray]:
        """One RGB uint8 image per validation prompt from ``tr``'s EMA weights; the live weights are put back."""
        from model.sampler import decode_to_uint8, sample_latents

        unet = tr.unet
        tr.ema.store(unet.parameters())
        tr.ema.copy_to(unet.parameters())
        unet.eval()
        try:
            gens = [torch.Generator().manual_seed(self.seed + i) for i in range(len(self.prompts))]
            latents = sample_latents(
                unet,
                self.ddim,
                self.cond,
                self.uncond,
                steps=self.steps,
                guidance_scale=self.guidance,
                latent_shape=self.shape,
                generators=gens,
            )
            return list(decode_to_uint8(self.vae, latents).numpy())
        finally:
            unet.train()
            tr.ema.restore(unet.parameters())
