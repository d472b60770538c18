"""Rectified flow (flow matching) on the SD UNet: interpolation, velocity target, σ sampling, Euler sampler.

Pure torch + diffusers; no I/O. A sample at noise level σ ∈ (0, 1) is the straight line between data and
noise, ``x_σ = (1 − σ)·x0 + σ·ε``, and the UNet predicts its velocity ``v = ε − x0`` (Liu et al. 2022,
Esser et al. 2024 — SD3). The UNet's timestep input is ``σ · num_train_timesteps``, so the same
sinusoidal embedding serves both objectives. Sampling integrates ``dx/dσ = v`` from σ = 1 to 0 with Euler
steps: :func:`model.sampler.flow_euler_scheduler`.
"""

from __future__ import annotations

from functools import partial

import torch

from model.denoisers import family_of
from model.diffusion import Generators, LossDraws, diffusion_loss, draw, draw_noise, draw_xi


def shift_sigmas(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3's resolution shift ``shift·σ / (1 + (shift − 1)·σ)``: shift > 1 moves steps to higher noise."""
    if shift == 1.0:
        return sigma
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def sample_sigmas(
    batch: int, generator: Generators, logit_normal: tuple[float, float] | None = None, shift: float = 1.0
) -> torch.Tensor:
    """Training noise levels ``[B]`` in (0, 1): uniform, or ``sigmoid(mean + std·z)`` with ``logit_normal =
    (mean, std)``; then :func:`shift_sigmas`."""
    if logit_normal is None:
        u = draw(generator, (batch,), partial(torch.rand, dtype=torch.float32))
    else:
        mean, std = logit_normal
        u = torch.sigmoid(mean + std * draw(generator, (batch,), partial(torch.randn, dtype=torch.float32)))
    return shift_sigmas(u, shift)


def interpolate(latents: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``x_σ = (1 − σ)·x0 + σ·ε`` with one σ per sample."""
    s = sigma.to(latents.dtype).view(-1, *([1] * (latents.ndim - 1)))
    return (1.0 - s) * latents + s * noise


def draw_flow(
    shape: tuple[int, ...],
    generator: Generators,
    logit_normal: tuple[float, float] | None = None,
    shift: float = 1.0,
    noise_offset: float = 0.0,
    input_perturbation: float = 0.0,
) -> LossDraws:
    """:func:`flow_matching_loss`'s draws for latents of ``shape`` (CPU): noise, its offset, σ (shifted), ξ."""
    noise = draw_noise(shape, generator, noise_offset)
    sigma = sample_sigmas(shape[0], generator, logit_normal, shift)
    return LossDraws(noise, sigma, draw_xi(shape, generator, input_perturbation))


def flow_matching_loss(
    unet: torch.nn.Module,
    latents: torch.Tensor,
    cond: torch.Tensor,
    generator: Generators,
    *,
    num_train_timesteps: int,
    logit_normal: tuple[float, float] | None = None,
    shift: float = 1.0,
    noise_offset: float = 0.0,
    input_perturbation: float = 0.0,
    reduce: bool = True,
) -> torch.Tensor:
    """One micro-batch's rectified-flow loss: MSE between the UNet's output and ``ε − x0`` (per sample when
    not ``reduce``).

    Draw order per sample (as :func:`model.diffusion.denoising_loss`): noise, its offset, σ, then the
    input perturbation ``ξ`` — the model sees ``x_σ`` built from ``ε + γ·ξ``, the target keeps ``ε``
    (:func:`draw_flow`; the loss given them: :func:`flow_matching_loss_from`).
    """
    draws = draw_flow(tuple(latents.shape), generator, logit_normal, shift, noise_offset, input_perturbation)
    return flow_matching_loss_from(unet, latents, cond, draws.to(latents.device), num_train_timesteps,
                                   input_perturbation, reduce)  # fmt: skip


def flow_matching_loss_from(
    unet: torch.nn.Module,
    latents: torch.Tensor,
    cond: torch.Tensor,
    draws: LossDraws,
    num_train_timesteps: int,
    input_perturbation: float = 0.0,
    reduce: bool = True,
) -> torch.Tensor:
    """:func:`flow_matching_loss` given its draws (on the latents' device): device work only, no host read."""
    sigma = draws.level
    x_t = interpolate(latents, draws.model_noise(input_perturbation), sigma)
    pred = family_of(unet).predict(unet, x_t, sigma * num_train_timesteps, cond)
    return diffusion_loss(pred, draws.noise - latents, None, reduce)
