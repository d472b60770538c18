"""VAE latent maths: images ↔ scaled latents. The scaling factor is read from the VAE config only."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKL


def scaling_factor(vae: AutoencoderKL) -> float:
    """The latent scaling factor (SD1: 0.18215), from the VAE's config: the one place it is defined."""
    return float(vae.config.scaling_factor)


def images_to_tensor(images: list[np.ndarray]) -> torch.Tensor:
    """RGB uint8 ``[H, W, 3]`` arrays (same size) → float tensor ``[B, 3, H, W]`` in ``[-1, 1]``."""
    return uint8_to_model_range(torch.from_numpy(np.stack(images)))


def uint8_to_model_range(batch: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """uint8 ``[B, H, W, 3]`` (any device) → float32 ``[B, 3, H, W]`` in ``[-1, 1]``.

    ``channels_last`` keeps the NHWC memory layout (what a channels_last VAE wants on CUDA);
    otherwise the result is contiguous NCHW.
    """
    x = batch.permute(0, 3, 1, 2)
    x = x.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    return x.float().div_(127.5).sub_(1.0)


@torch.no_grad()
def encode_latents(vae: AutoencoderKL, pixels: torch.Tensor) -> torch.Tensor:
    """``vae.encode(x).latent_dist.mean × scaling_factor`` (posterior mean, not a sample), fp32.

    ``pixels`` keeps its memory format; under an active autocast the encoder runs in its dtype.
    """
    pixels = pixels.to(device=vae.device, dtype=vae.dtype)
    mean = vae.encode(pixels).latent_dist.mean
    return mean.float() * scaling_factor(vae)
