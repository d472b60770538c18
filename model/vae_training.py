"""Train a small ``AutoencoderKL`` and measure its latent scale (the demo's stand-in for sd-vae-ft-mse).

Pure torch; the caller supplies image batches in ``[-1, 1]`` (B×3×H×W).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch
from diffusers import AutoencoderKL


def vae_loss(vae: AutoencoderKL, images: torch.Tensor, kl_weight: float) -> torch.Tensor:
    """L1 + MSE reconstruction of a posterior sample, plus ``kl_weight`` × KL to N(0, I).

    The KL is summed over latent dims and averaged over the batch, then divided by the pixel
    count so ``kl_weight`` is comparable across image sizes.
    """
    posterior = vae.encode(images).latent_dist
    recon = vae.decode(posterior.sample()).sample
    err = recon - images
    loss = err.abs().mean() + err.pow(2).mean()
    if kl_weight:
        loss = loss + kl_weight * posterior.kl().mean() / images[0].numel()
    return loss


def train_vae(
    vae: AutoencoderKL,
    batches: Iterator[torch.Tensor],
    steps: int,
    lr: float,
    kl_weight: float,
    grad_clip: float = 1.0,
) -> list[float]:
    """Train ``vae`` in place for ``steps`` AdamW steps (cosine decay to lr/10); return per-step losses.

    The posterior sample is drawn from the global torch RNG: seed it for reproducible weights.
    A non-finite loss raises ``FloatingPointError`` naming the step.
    """
    if steps <= 0:
        return []
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    losses: list[float] = []
    for step in range(steps):
        images = next(batches)
        loss = vae_loss(vae, images, kl_weight)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"VAE loss is {value} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), grad_clip)
        opt.step()
        sched.step()
        losses.append(value)
    vae.eval()
    return losses


@torch.no_grad()
def reconstruct(vae: AutoencoderKL, images: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """Decode the posterior mean of ``images`` (what training and sampling see), clamped to [-1, 1]."""
    vae.eval()
    out = [
        vae.decode(vae.encode(chunk).latent_dist.mean).sample.clamp(-1, 1)
        for chunk in images.split(batch_size)
    ]
    return torch.cat(out)


@torch.no_grad()
def latent_scaling_factor(vae: AutoencoderKL, images: Iterable[torch.Tensor] | torch.Tensor) -> float:
    """``1 / std`` of the posterior means of ``images``: latents × factor have unit std (SD convention)."""
    vae.eval()
    chunks = [images] if isinstance(images, torch.Tensor) else images
    means = torch.cat([vae.encode(chunk).latent_dist.mean.flatten() for chunk in chunks])
    std = float(means.double().std())
    if not math.isfinite(std) or std <= 0:
        raise ValueError(f"latent std must be finite and > 0 to set a scaling factor; got {std}")
    return 1.0 / std
