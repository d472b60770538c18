"""Text-to-image sampling: DDIM (diffusion phases) or Euler (flow-matching phases) with classifier-free
guidance and a real negative prompt; LCM for consistency-distilled (``distill``) diffusion phases.

One sampler for the eval grid, ``sdforge generate`` and validation during training.
The DDIM scheduler never clamps the predicted x0 (SD latents have std ≈ 4 before scaling;
the reference run's ``clamp(-1, 1)`` was a bug), and uses the training betas. All are diffusers
schedulers that ``StableDiffusionPipeline`` runs, so an exported folder samples what we sample.

Distilled phases (LCM-LoRA, ``phases.<p>.distill``) sample in a few steps with guidance 1 (the guidance is in
the teacher's solve; with ``guidance_scale <= 1`` :func:`sample_latents` makes one UNet call per step on the
prompt alone, as ``StableDiffusionPipeline`` does):

- diffusion: diffusers' ``LCMScheduler`` (:func:`lcm_scheduler`): each step takes the student's consistency
  value ``c_skip·x + c_out·x0̂`` and re-noises it to the next timestep with fresh noise from the image's own
  generator;
- flow matching: the flow Euler sampler's stochastic variant (:func:`flow_euler_scheduler` with ``stochastic``:
  first-order SDE-DPM-Solver++ on flow sigmas). Each step takes ``x0̂ = x − σ·v`` — the student's consistency
  value — and moves to the next σ with partly fresh noise from the image's generator (all fresh from σ ≈ 1).
  diffusers' ``FlowMatchLCMScheduler`` (LCM's rule: ``(1 − σ')·x0̂ + σ'·z``, all fresh) cannot run in
  ``StableDiffusionPipeline`` (no ``init_noise_sigma`` nor ``scale_model_input`` in diffusers 0.42), and an export
  must be a plain ``StableDiffusionPipeline`` folder that draws our pixels. Measured on the demo's phase 9 (six
  runs, 64 seen-prompt images each, 4 steps): shape agreement 89–98 % with this sampler, 95–98 % with LCM's
  rule, 89–91 % with the deterministic Euler step (no fresh noise; docs/ADAPTERS.md "Distillation").
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch

from model.denoisers import family_of, uncropped_sizes

if TYPE_CHECKING:  # annotations only: the schedulers are imported where they are built (see ddim_from_training)
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        DPMSolverMultistepScheduler,
        LCMScheduler,
        SchedulerMixin,
    )

OBJECTIVES = ("diffusion", "flow_matching")
TRAINING_KEYS = (
    "num_train_timesteps",
    "beta_start",
    "beta_end",
    "beta_schedule",
    "prediction_type",
    "rescale_betas_zero_snr",
)
"""The training scheduler's keys a diffusion sampler takes over (the betas and what the UNet predicts)."""


def _training_keys(train_scheduler_config: dict) -> dict:
    """The :data:`TRAINING_KEYS` present in ``train_scheduler_config``."""
    return {k: train_scheduler_config[k] for k in TRAINING_KEYS if k in train_scheduler_config}


def ddim_from_training(train_scheduler_config: dict) -> DDIMScheduler:
    """A DDIM scheduler with the training betas, ``clip_sample=False`` and ``set_alpha_to_one=False``.

    With zero-terminal-SNR betas the timesteps are "trailing", so sampling starts at t = T where
    the model was trained on pure noise (Lin et al. 2023); otherwise SD's "leading" + offset 1.
    """
    from diffusers import DDIMScheduler  # lazy: diffusers costs 4-6 s to import, and a skipped eval grid imports this

    cfg = _training_keys(train_scheduler_config)
    spacing = "trailing" if cfg.get("rescale_betas_zero_snr") else "leading"
    # steps_offset only shifts "leading" timesteps; 1 everywhere, because diffusers' StableDiffusionPipeline
    # rewrites any other value to 1 (with a deprecation warning) when it loads an exported folder
    return DDIMScheduler(**cfg, clip_sample=False, set_alpha_to_one=False, steps_offset=1, timestep_spacing=spacing)


def flow_euler_scheduler(
    num_train_timesteps: int = 1000, shift: float = 1.0, stochastic: bool = False
) -> DPMSolverMultistepScheduler:
    """The Euler sampler for flow-matching phases, as a diffusers scheduler that ``StableDiffusionPipeline`` runs.

    First-order DPM-Solver++ on flow sigmas (``use_flow_sigmas``, ``prediction_type="flow_prediction"``): it
    predicts ``x0 = x − σ·v`` and steps to ``(1 − σ')·x0 + σ'·(x + (1 − σ)·v)``, which is ``x + (σ' − σ)·v``,
    the Euler step (tests/model/test_flow_matching.py checks it against the Euler update to 1e-6). Steps go
    from σ = 0.999 to 0 evenly (shifted by ``shift``); the UNet sees ``⌊σ·1000⌋``. diffusers'
    ``FlowMatchEulerDiscreteScheduler`` does the same maths but has no ``init_noise_sigma``, which
    ``StableDiffusionPipeline`` reads (AttributeError in diffusers 0.42), so the export could not use it.

    ``stochastic``: first-order SDE-DPM-Solver++ instead (``algorithm_type="sde-dpmsolver++"``), the sampler of a
    consistency-distilled flow phase: each step takes ``x0 = x − σ·v`` (the student's consistency value) and moves
    to ``σ'`` keeping ``e^{−h}`` of the current point's noise and drawing the rest fresh from the image's generator
    (``h`` the step in log-SNR; at the first step, from σ ≈ 1, ~all of it is fresh: LCM's re-noising).
    """
    from diffusers import DPMSolverMultistepScheduler  # lazy: diffusers costs 4-6 s to import (ddim_from_training)

    return DPMSolverMultistepScheduler(
        num_train_timesteps=num_train_timesteps,
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        flow_shift=shift,
        solver_order=1,
        algorithm_type="sde-dpmsolver++" if stochastic else "dpmsolver++",
        final_sigmas_type="zero",
        steps_offset=1,  # unused by flow sigmas; StableDiffusionPipeline rewrites any other value (with a warning)
    )


def lcm_scheduler(
    train_scheduler_config: dict, num_ddim_timesteps: int = 50, timestep_scaling: float = 10.0
) -> LCMScheduler:
    """diffusers' ``LCMScheduler`` for a consistency-distilled diffusion phase: the training betas and prediction
    type, the distillation's solver grid (``original_inference_steps``: timesteps ``k·T/N − 1``) and boundary
    scalings (``timestep_scaling``), no x0 clamp."""
    from diffusers import LCMScheduler  # lazy: diffusers costs 4-6 s to import (ddim_from_training)

    return LCMScheduler(
        **_training_keys(train_scheduler_config),
        original_inference_steps=num_ddim_timesteps,
        timestep_scaling=timestep_scaling,
        clip_sample=False,
        steps_offset=1,  # unused by LCM's timesteps; StableDiffusionPipeline rewrites any other value (with a warning)
    )


def sampling_scheduler(
    train_scheduler_config: dict,
    objective: str = "diffusion",
    flow_shift: float = 1.0,
    distill: dict | None = None,
    flow_euler: bool = False,
):
    """The sampler's scheduler for a checkpoint trained with ``objective``: :func:`ddim_from_training` for
    diffusion (:func:`lcm_scheduler` when ``distill``, the phase's ``Distill`` options as a dict, is given),
    :func:`flow_euler_scheduler` (same ``num_train_timesteps``) for flow matching, its stochastic variant when
    distilled (see the module docstring). ``flow_euler`` (a family whose pipeline runs it, ``mmdit``): diffusers'
    ``FlowMatchEulerDiscreteScheduler`` with the shift for flow matching instead, the same Euler maths."""
    if objective == "diffusion" and distill:
        return lcm_scheduler(train_scheduler_config, distill["num_ddim_timesteps"], distill["timestep_scaling"])
    if objective == "diffusion":
        return ddim_from_training(train_scheduler_config)
    if objective == "flow_matching" and flow_euler and not distill:
        # lazy: diffusers costs 4-6 s to import (ddim_from_training)
        from diffusers import FlowMatchEulerDiscreteScheduler

        steps = train_scheduler_config.get("num_train_timesteps", 1000)
        return FlowMatchEulerDiscreteScheduler(steps, shift=flow_shift)
    if objective == "flow_matching":
        steps = train_scheduler_config.get("num_train_timesteps", 1000)
        return flow_euler_scheduler(steps, flow_shift, stochastic=bool(distill))
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
    unet: torch.nn.Module,
    scheduler: SchedulerMixin,
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
    *,
    steps: int,
    guidance_scale: float,
    latent_shape: tuple[int, int, int],
    generators: list[torch.Generator],
    image_px: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Sampling with CFG, ``out = out_u + s·(out_c − out_u)`` on the UNet's output (ε, v or flow velocity), with
    ``scheduler``'s steps (:func:`sampling_scheduler`); returns latents ``[B, C, h, w]``.

    ``uncond`` is the negative-prompt embedding (``[1|B, L, D]``). With ``guidance_scale <= 1`` there is no CFG:
    one UNet call per step on ``cond`` alone, ``uncond`` unused (may be None) — as in ``StableDiffusionPipeline``.
    Sample ``i``'s initial noise, and any noise the scheduler draws between steps (LCM), comes from
    ``generators[i]`` on the CPU, so an image depends only on its own seed — not on the device or on which other
    prompts share its batch. ``image_px`` ``(height, width)``: the micro-conditioning of a family that takes it
    (:func:`model.denoisers.uncropped_sizes`, the SDXL pipeline's default).
    """
    device = next(unet.parameters()).device
    family = family_of(unet)
    batch = cond.shape[0]
    if len(generators) != batch:
        raise ValueError(f"need one generator per prompt: {batch} prompts, {len(generators)} generators")
    latents = torch.stack([torch.randn(latent_shape, generator=g, dtype=torch.float32) for g in generators])
    latents = (latents * getattr(scheduler, "init_noise_sigma", 1.0)).to(device)
    cfg = guidance_scale > 1
    context = _context(cond, uncond if cfg else None).to(device=device, dtype=unet.dtype)
    if image_px is not None:
        context = family.sized(context, uncropped_sizes(*image_px).to(device))
    # per-row draws on each CPU generator, as the pipeline's randn_tensor makes them (prepare_extra_step_kwargs)
    extra = {"generator": generators} if "generator" in inspect.signature(scheduler.step).parameters else {}
    scheduler.set_timesteps(steps, device=device)
    for t in scheduler.timesteps:
        model_in = torch.cat([latents, latents]) if cfg else latents
        if hasattr(scheduler, "scale_model_input"):  # FlowMatchEulerDiscreteScheduler has none (its input is x)
            model_in = scheduler.scale_model_input(model_in, t)
        out = family.predict(unet, model_in.to(unet.dtype), t, context).float()
        if cfg:
            out_u, out_c = out.chunk(2)
            out = out_u + guidance_scale * (out_c - out_u)
        latents = scheduler.step(out, t, latents, **extra).prev_sample
    return latents


def _context(cond: torch.Tensor, uncond: torch.Tensor | None) -> torch.Tensor:
    """The UNet's text states: ``[uncond; cond]`` for CFG (``uncond`` ``[1|B, L, D]`` expanded to ``B``), else
    ``cond``."""
    if uncond is None:
        return cond
    uncond = uncond.expand(cond.shape[0], -1, -1) if uncond.shape[0] == 1 else uncond
    return torch.cat([uncond, cond])


@torch.no_grad()
def decode_to_uint8(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    """Decode scaled latents to ``[B, H, W, 3]`` uint8 images on the CPU."""
    images = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor).sample
    images = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return images.permute(0, 2, 3, 1).cpu()


def latent_shape_for(
    unet: torch.nn.Module,
    vae: AutoencoderKL,
    image_size: int | None = None,
    *,
    width: int | None = None,
    height: int | None = None,
) -> tuple[int, int, int]:
    """``(C, h, w)`` of the latents for a ``width``×``height`` image; a side not given is ``image_size``, else
    the UNet's sample size in pixels. Both sides must be multiples of :func:`pixel_multiple` (64 px for SD)."""
    factor = vae_factor(vae)
    default = trained_image_side(unet, vae) if image_size is None else image_size
    w, h = width or default, height or default
    multiple = pixel_multiple(unet, vae)
    if w % multiple or h % multiple:
        raise ValueError(f"image size {w}×{h}: width and height must be multiples of {multiple} px for this model")
    return (family_of(unet).latent_channels(unet), h // factor, w // factor)


def trained_image_side(unet: torch.nn.Module, vae: AutoencoderKL) -> int:
    """The image side in px the UNet was built for: its sample size × the VAE's downsampling (512 for SD 1.x)."""
    return family_of(unet).trained_side(unet, vae_factor(vae))


def pixel_multiple(unet: torch.nn.Module, vae: AutoencoderKL) -> int:
    """The pixel multiple an image side must be: the VAE's downsampling times the UNet's (64 for SD 1.x)."""
    return family_of(unet).pixel_multiple(unet, vae_factor(vae))


def vae_factor(vae: AutoencoderKL) -> int:
    """Pixels per latent cell along one side (8 for SD's VAE)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)
