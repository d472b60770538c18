"""VAE latent maths: images ↔ scaled latents. The scaling factor is read from the VAE config only."""

from __future__ import annotations

import numpy as np
import torch
from diffusers import AutoencoderKL


def images_to_tensor(images: list[np.ndarray]) -> torch.Tensor:
    """RGB uint8 ``[H, W, 3]`` arrays (same size) → float tensor ``[B, 3, H, W]`` in ``[-1, 1]``."""
    batch = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float()
    return batch / 127.5 - 1.0


@torch.no_grad()
def encode_latents(vae: AutoencoderKL, pixels: torch.Tensor) -> torch.Tensor:
    """``vae.encode(x).latent_dist.mean × scaling_factor`` (posterior mean, not a sample), fp32."""
    pixels = pixels.to(device=vae.device, dtype=vae.dtype)
    mean = vae.encode(pixels).latent_dist.mean
    return mean.float() * vae.config.scaling_factor
