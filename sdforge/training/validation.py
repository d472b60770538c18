"""Validation images during training: the eval sampler on the EMA weights every ``train.validation_every`` steps.

The first ``train.validation_prompts`` eval prompts, with ``eval``'s default steps, guidance,
negative prompt and seeds (``eval.seed + i``), so the images line up with the phase's eval grid.
Sampling draws its noise from its own CPU generators and swaps the EMA weights in and back out
exactly, so a run with validation trains bit-identically to one without.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from diffusers import AutoencoderKL

from sdforge.config import Params
from sdforge.eval.sampling import Pipeline, generate


class Validator:
    """Samples the validation prompts from a :class:`sdforge.training.trainer.Trainer`'s EMA weights (main rank)."""

    def __init__(self, params: Params, tr) -> None:
        ev = params.eval
        self.every = params.train.validation_every
        self.prompts = ev.all_prompts[: params.train.validation_prompts]
        self.steps, self.guidance, self.seed, self.negative = ev.steps, ev.guidance_scale, ev.seed, ev.negative_prompt
        self.vae = AutoencoderKL.from_pretrained(Path(params.paths.models) / "vae").to(tr.dist.device).eval()

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` gets validation images."""
        return self.every > 0 and step % self.every == 0

    def images(self, tr) -> list[np.ndarray]:
        """One RGB uint8 image per validation prompt from ``tr``'s EMA weights; the live weights are put back."""
        unet = tr.unet
        pipe = Pipeline(
            unet,
            self.vae,
            tr.text_encoder,
            tr.tokenizer,
            dict(tr.scheduler.config),
            checkpoint_hash="",
            objective=tr.objective,
            flow_shift=tr.phase.flow_shift,
        )
        tr.ema.store(tr.trainable)
        tr.ema.copy_to(tr.trainable)
        unet.eval()
        try:
            return generate(
                pipe,
                self.prompts,
                negative_prompt=self.negative,
                steps=self.steps,
                guidance_scale=self.guidance,
                seeds=[self.seed + i for i in range(len(self.prompts))],
                batch_size=len(self.prompts),
            )
        finally:
            unet.train()
            tr.ema.restore(tr.trainable)
