"""Text-to-image sampling: DDIM (diffusion phases) or Euler (flow-matching phases) with classifier-free
guidance and a real negative prompt.

One sampler for the eval grid, ``sdforge generate`` and validation during training.
The DDIM scheduler never clamps the predicted x0 (SD latents have std ≈ 4 before scaling;
the reference run's ``clamp(-1, 1)`` was a bug), and uses the training betas. Both are diffusers
schedulers that ``StableDiffusionPipeline`` runs, so an exported folder samples what we sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: the schedulers are imported where they are built (see ddim_from_training)
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        DPMSolverMultistepScheduler,
        SchedulerMixin,
        UNet2DConditionModel,
    )

OBJECTIVES = ("diffusion", "flow_matching")


def ddim_from_training(train_scheduler_config: dict) -> DDIMScheduler:
    """A DDIM scheduler with the training betas, ``clip_sample=False`` and ``set_alpha_to_one=False``.

    With zero-terminal-SNR betas the timesteps are "trailing", so sampling starts at t = T where
    the model was trained on pure noise (Lin et al. 2023); otherwise SD's "leading" + offset 1.
    """
    keys = (
        "num_train_timesteps",
        "beta_start",
        "beta_end",
        "beta_schedule",
        "prediction_type",
        "rescale_betas_zero_snr",
    )
    from diffusers import DDIMScheduler  # lazy: diffusers costs 4-6 s to import, and a skipped eval grid imports this

    cfg = {k: train_scheduler_config[k] for k in keys if k in train_scheduler_config}
    spacing = "trailing" if cfg.get("rescale_betas_zero_snr") else "leading"
    # steps_offset only shifts "leading" timesteps; 1 everywhere, because diffusers' StableDiffusionPipeline
    # rewrites any other value to 1 (with a deprecation warning) when it loads an exported folder
    return DDIMScheduler(**cfg, clip_sample=False, set_alpha_to_one=False, steps_offset=1, timestep_spacing=spacing)


def flow_euler_scheduler(num_train_timesteps: int = 1000, shift: float = 1.0) -> DPMSolverMultistepScheduler:
    """The Euler sampler for flow-matching phases, as a diffusers scheduler that ``StableDiffusionPipeline`` runs.

    First-order DPM-Solver++ on flow sigmas (``use_flow_sigmas``, ``prediction_type="flow_prediction"``): it
    predicts ``x0 = x − σ·v`` and steps to ``(1 − σ')·x0 + σ'·(x + (1 − σ)·v)``, which is ``x + (σ' − σ)·v``,
    the Euler step (tests/model/test_flow_matching.py checks it against the Euler update to 1e-6). Steps go
    from σ = 0.999 to 0 evenly (shifted by ``shift``); the UNet sees ``⌊σ·1000⌋``. diffusers'
    ``FlowMatchEulerDiscreteScheduler`` does the same maths but has no ``init_noise_sigma``, which
    ``StableDiffusionPipeline`` reads (AttributeError in diffusers 0.42), so the export could not use it.
    """
    from diffusers import DPMSolverMultistepScheduler  # lazy: diffusers costs 4-6 s to import (ddim_from_training)

    return DPMSolverMultistepScheduler(
        num_train_timesteps=num_train_timesteps,
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        flow_shift=shift,
        solver_order=1,
        algorithm_type="dpmsolver++",
        final_sigmas_type="zero",
        steps_offset=1,  # unused by flow sigmas; StableDiffusionPipeline rewrites any other value (with a warning)
    )


def sampling_scheduler(train_scheduler_config: dict, objective: str = "diffusion", flow_shift: float = 1.0):
    """The sampler's scheduler for a checkpoint trained with ``objective``: :func:`ddim_from_training` for
    diffusion, :func:`flow_euler_scheduler` (same ``num_train_timesteps``) for flow matching."""
    if objective == "diffusion":
        return ddim_from_training(train_scheduler_config)
    if objective == "flow_matching":
        return flow_euler_scheduler(train_scheduler_config.get("num_train_timesteps", 1000), flow_shift)
    raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}; got {objective!r}")


@torch.no_grad()
def encode_prompts(tokenizer, text_encoder, prompts: list[str], device: torch.device | str) -> torch.Tensor:
    """``last_hidden_state`` of the text encoder for ``prompts`` padded/truncated to the model length."""
    ids = tokenizer(
        prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids
    return text_encoder(ids.to(device))[0]


@torch.no_grad()
def sample_latents(
    unet: UNet2DConditionModel,
    scheduler: SchedulerMixin,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    *,
    steps: int,
    guidance_scale: float,
    latent_shape: tuple[int, int, int],
    generators: list[torch.Generator],
) -> torch.Tensor:
    """Sampling with CFG, ``out = out_u + s·(out_c − out_u)`` on the UNet's output (ε, v or flow velocity), with
    ``scheduler``'s steps (:func:`sampling_scheduler`); returns latents ``[B, C, h, w]``.

    ``uncond`` is the negative-prompt embedding (``[1|B, L, D]``). Sample ``i``'s initial noise
    comes from ``generators[i]`` on the CPU, so an image depends only on its own seed — not on
    the device or on which other prompts share its batch.
    """
    device = next(unet.parameters()).device
    batch = cond.shape[0]
    if len(generators) != batch:
        raise ValueError(f"need one generator per prompt: {batch} prompts, {len(generators)} generators")
    latents = torch.stack([torch.randn(latent_shape, generator=g, dtype=torch.float32) for g in generators])
    latents = (latents * scheduler.init_noise_sigma).to(device)
    uncond = uncond.expand(batch, -1, -1) if uncond.shape[0] == 1 else uncond
    context = torch.cat([uncond, cond]).to(device=device, dtype=unet.dtype)
    scheduler.set_timesteps(steps, device=device)
    for t in scheduler.timesteps:
        model_in = scheduler.scale_model_input(torch.cat([latents, latents]), t)
        eps_u, eps_c = unet(model_in.to(unet.dtype), t, encoder_hidden_states=context).sample.float().chunk(2)
        eps = eps_u + guidance_scale * (eps_c - eps_u)
        latents = scheduler.step(eps, t, latents).prev_sample
    return latents


@torch.no_grad()
def decode_to_uint8(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    """Decode scaled latents to ``[B, H, W, 3]`` uint8 images on the CPU."""
    images = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor).sample
    images = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return images.permute(0, 2, 3, 1).cpu()


def latent_shape_for(
    unet: UNet2DConditionModel,
    vae: AutoencoderKL,
    image_size: int | None = None,
    *,
    width: int | None = None,
    height: int | None = None,
) -> tuple[int, int, int]:
    """``(C, h, w)`` of the latents for a ``width``×``height`` image; a side not given is ``image_size``, else
    the UNet's sample size in pixels. Both sides must be multiples of :func:`pixel_multiple` (64 px for SD)."""
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    default = unet.config.sample_size * factor if image_size is None else image_size
    w, h = width or default, height or default
    multiple = pixel_multiple(unet, vae)
    if w % multiple or h % multiple:
        raise ValueError(f"image size {w}×{h}: width and height must be multiples of {multiple} px for this model")
    return (unet.config.in_channels, h // factor, w // factor)


def pixel_multiple(unet: UNet2DConditionModel, vae: AutoencoderKL) -> int:
    """The pixel multiple an image side must be: the VAE's downsampling times the UNet's (64 for SD 1.x)."""
    vae_factor = 2 ** (len(vae.config.block_out_channels) - 1)
    return vae_factor * 2 ** (len(unet.config.down_block_types) - 1)
