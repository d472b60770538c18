"""The validation loss on held-out samples: the objective's plain MSE at fixed noise levels with fixed noise.

Pure torch + diffusers; no I/O. Two checkpoints are compared on identical inputs: every sample is noised at the
same ``K`` evenly spaced levels (``fractions``: ``(k + 0.5) / K``) with the same noise (the caller seeds it per
sample), and the loss is unweighted (no Min-SNR, no CFG dropout, no input perturbation or noise offset), so
it moves only with the weights. For flow matching a fraction is σ itself (unshifted: phases with different
``flow_shift`` stay comparable); for diffusion it is the timestep ``⌊fraction · T⌋``. torchtitan's FLUX validator
measures the same way (8 fixed timesteps); the SD3 paper reports that this loss tracks GenEval.
"""

from __future__ import annotations

import torch
from diffusers import DDPMScheduler

from model.denoisers import family_of
from model.diffusion import diffusion_loss, training_target
from model.flow_matching import interpolate


def fixed_fractions(points: int) -> torch.Tensor:
    """``[K]`` evenly spaced noise levels in (0, 1): ``(k + 0.5) / K``."""
    if points < 1:
        raise ValueError(f"need at least one noise level; got {points}")
    return (torch.arange(points, dtype=torch.float32) + 0.5) / points


def fixed_timesteps(fractions: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
    """The diffusion timesteps ``⌊fraction · T⌋`` of :func:`fixed_fractions` (int64, in ``[0, T)``)."""
    return (fractions * num_train_timesteps).long().clamp_(0, num_train_timesteps - 1)


@torch.no_grad()
def held_out_losses(
    unet: torch.nn.Module,
    latents: torch.Tensor,
    cond: torch.Tensor,
    noise: torch.Tensor,
    fractions: torch.Tensor,
    *,
    objective: str,
    scheduler: DDPMScheduler,
) -> torch.Tensor:
    """``[B, K]`` per-sample, per-level MSE of the UNet's prediction against the objective's target
    (flow matching: ``ε − x0`` at σ = fraction; diffusion: ε or v at ``⌊fraction · T⌋``), fp32 on the device."""
    steps, batch = scheduler.config.num_train_timesteps, latents.shape[0]
    out = []
    for fraction, timestep in zip(fractions.tolist(), fixed_timesteps(fractions, steps).tolist(), strict=True):
        if objective == "flow_matching":
            sigma = torch.full((batch,), fraction, device=latents.device)
            x_t, target = interpolate(latents, noise, sigma), noise - latents
            t = sigma * steps
        else:
            t = torch.full((batch,), timestep, dtype=torch.long, device=latents.device)
            x_t, target = scheduler.add_noise(latents, noise, t), training_target(scheduler, latents, noise, t)
        pred = family_of(unet).predict(unet, x_t, t, cond)
        out.append(diffusion_loss(pred, target, None, reduce=False))
    return torch.stack(out, dim=1)
