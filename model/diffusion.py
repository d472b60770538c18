"""Training maths for latent diffusion: noise, targets, Min-SNR weights, CFG dropout, LR schedule, EMA decay.

Pure torch + diffusers; no I/O. Shapes: latents ``[B, C, h, w]``, timesteps ``[B]`` (long).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from diffusers import DDPMScheduler
from diffusers.training_utils import EMAModel, compute_snr

from model.denoisers import family_of

PREDICTION_TYPES = ("epsilon", "v_prediction")


def check_prediction_type(prediction_type: str) -> str:
    """Return ``prediction_type`` if supported, else raise naming the allowed values."""
    if prediction_type not in PREDICTION_TYPES:
        raise ValueError(f"prediction type must be one of {', '.join(PREDICTION_TYPES)}; got {prediction_type!r}")
    return prediction_type


Generators = torch.Generator | Sequence[torch.Generator]
"""One stream for the whole batch, or one per sample (row ``b`` drawn from ``generator[b]``)."""


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (drawn on the CPU) on ``device`` without a host synchronisation: to CUDA through pinned memory
    and a non-blocking copy (a pageable copy waits for the stream); elsewhere a plain ``.to``. Same values."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def draw(generator: Generators, shape: tuple[int, ...], fn: Callable[..., torch.Tensor]) -> torch.Tensor:
    """``fn(shape, generator=g)`` for a ``[B, ...]`` draw: from one stream, or row by row from per-sample streams.

    Per-sample streams make a sample's noise, timestep and CFG drop independent of which rank and
    batch it lands in (DDP with batch B on each of N ranks draws what one process with batch N·B does).
    """
    if isinstance(generator, torch.Generator):
        return fn(shape, generator=generator)
    if len(generator) != shape[0]:
        raise ValueError(f"per-sample generators: need one per row ({shape[0]}); got {len(generator)}")
    return torch.stack([fn(shape[1:], generator=g) for g in generator])


def sample_timesteps(
    batch: int, num_train_timesteps: int, generator: Generators, logit_normal: tuple[float, float] | None = None
) -> torch.Tensor:
    """Integer timesteps in ``[0, num_train_timesteps)``: uniform, or logit-normal when ``logit_normal`` =
    ``(mean, std)`` — ``t = ⌊sigmoid(mean + std·z) · T⌋`` with ``z ~ N(0, 1)`` (Esser et al. 2024, SD3's
    timestep density). A positive mean puts more of the steps at high noise, where the image's layout —
    which shape, which colour, where — is decided and only the prompt can tell the model what to draw."""
    if logit_normal is None:
        return draw(generator, (batch,), partial(torch.randint, 0, num_train_timesteps, dtype=torch.long))
    mean, std = logit_normal
    z = draw(generator, (batch,), partial(torch.randn, dtype=torch.float32))
    t = torch.sigmoid(mean + std * z) * num_train_timesteps
    return t.long().clamp_(0, num_train_timesteps - 1)


def training_target(
    scheduler: DDPMScheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor
) -> torch.Tensor:
    """The UNet's regression target: ``noise`` (epsilon) or ``v = √ᾱ·ε − √(1−ᾱ)·x0`` (v_prediction)."""
    prediction_type = check_prediction_type(scheduler.config.prediction_type)
    if prediction_type == "epsilon":
        return noise
    return scheduler.get_velocity(latents, noise, timesteps)


def min_snr_weights(scheduler: DDPMScheduler, timesteps: torch.Tensor, gamma: float | None) -> torch.Tensor | None:
    """Per-sample Min-SNR-γ loss weights (Hang et al. 2023), or ``None`` when γ is off.

    epsilon: ``min(SNR, γ) / SNR``; v_prediction: ``min(SNR, γ) / (SNR + 1)``.
    """
    if gamma is None:
        return None
    prediction_type = check_prediction_type(scheduler.config.prediction_type)
    snr = compute_snr(scheduler, timesteps)
    clipped = torch.clamp(snr, max=gamma)
    if prediction_type == "epsilon":
        return clipped / snr
    return clipped / (snr + 1.0)


def diffusion_loss(
    pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None, reduce: bool = True
) -> torch.Tensor:
    """MSE per sample (mean over C,h,w), weighted per sample, averaged over the batch (fp32); the per-sample
    values when not ``reduce``."""
    per_sample = (pred.float() - target.float()).pow(2).mean(dim=tuple(range(1, pred.ndim)))
    if weights is not None:
        per_sample = per_sample * weights.to(per_sample.dtype)
    return per_sample.mean() if reduce else per_sample


def cfg_dropout(cond: torch.Tensor, uncond: torch.Tensor, rate: float, generator: Generators) -> torch.Tensor:
    """Replace each sample's text condition ``[B, L, D]`` by ``uncond`` ``[1, L, D]`` with probability ``rate``."""
    drop = drop_mask(cond.shape[0], rate, generator)
    if not bool(drop.any()):
        return cond
    return dropped_condition(cond, uncond, to_device(drop, cond.device))


def part_dropout(cond: torch.Tensor, uncond: torch.Tensor, parts: list, generator: Generators) -> torch.Tensor:
    """Replace each ``(part, rate)`` region of each sample's condition by ``uncond``'s with probability ``rate`` —
    one draw per part and sample, in ``parts``' order (``phases.<p>.caption_dropout``; a part is a
    :class:`model.denoisers.CondPart`)."""
    if not parts:
        return cond
    drop = part_drop_mask(cond.shape[0], parts, generator)
    if not bool(drop.any()):
        return cond
    regions = part_regions(parts, tuple(cond.shape[1:])).to(cond.device)
    return dropped_condition(cond, uncond, torch.zeros(cond.shape[0], dtype=torch.bool, device=cond.device),
                             to_device(drop, cond.device), regions)  # fmt: skip


def drop_mask(batch: int, rate: float, generator: Generators) -> torch.Tensor:
    """Which of ``batch`` samples lose their whole condition (``[B]`` bool): a draw each, none if ``rate`` ≤ 0."""
    if rate <= 0:
        return torch.zeros(batch, dtype=torch.bool)
    return draw(generator, (batch,), torch.rand) < rate


def part_drop_mask(batch: int, parts: list, generator: Generators) -> torch.Tensor:
    """Which parts each sample loses (``[B, P]`` bool), one draw per part and sample in ``parts``' order."""
    columns = [draw(generator, (batch,), torch.rand) < rate for _, rate in parts]
    return torch.stack(columns, dim=1) if columns else torch.zeros(batch, 0, dtype=torch.bool)


def part_regions(parts: list, shape: tuple[int, int]) -> torch.Tensor:
    """Each ``(part, rate)``'s region of a ``[L, D]`` condition as a ``[P, L, D]`` bool mask."""
    regions = torch.zeros(len(parts), *shape, dtype=torch.bool)
    for k, (part, _) in enumerate(parts):
        regions[k, part.rows, part.cols] = True
    return regions


def dropped_condition(
    cond: torch.Tensor,
    uncond: torch.Tensor,
    drop: torch.Tensor,
    part_drop: torch.Tensor | None = None,
    regions: torch.Tensor | None = None,
) -> torch.Tensor:
    """``cond`` with ``uncond`` wherever a sample's whole prompt is dropped (``drop`` ``[B]``) or a dropped part's
    region lies (``part_drop`` ``[B, P]`` of ``regions`` ``[P, L, D]``); all on ``cond``'s device, no host read."""
    mask = drop.view(-1, 1, 1)
    if part_drop is not None and part_drop.shape[1]:
        mask = mask | (part_drop[:, :, None, None] & regions[None]).any(dim=1)
    return torch.where(mask, uncond.to(cond.dtype).expand_as(cond), cond)


def lr_at(step: int, peak_lr: float, warmup_steps: int, total_steps: int, final_ratio: float = 1e-2) -> float:
    """Closed form of the schedule: linear warmup from ``peak·1e-2``, then cosine to ``peak·final_ratio``.

    ``step`` counts optimizer steps from 0. Matches :func:`build_lr_scheduler`.
    """
    if warmup_steps > 0 and step < warmup_steps:
        start = 1e-2
        return peak_lr * (start + (1.0 - start) * step / warmup_steps)
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(step - warmup_steps, decay_steps) / decay_steps
    eta_min = peak_lr * final_ratio
    return eta_min + (peak_lr - eta_min) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, peak_lr: float, warmup_steps: int, total_steps: int, final_ratio: float = 1e-2
) -> torch.optim.lr_scheduler.LRScheduler:
    """``SequentialLR(LinearLR(1e-2 → 1), CosineAnnealingLR(eta_min = peak·final_ratio))`` from ``peak_lr``.

    The peak is an argument, never read from the optimizer: a schedule rebuilt after warm-up has lowered the
    optimizer's LR (a run resumed on another world size before its first checkpoint) would otherwise take
    that LR as its peak and end at ``peak·1e-2·final_ratio``. Every param group's ``lr`` and ``initial_lr``
    are set to ``peak_lr`` first. ``total_steps`` must count *optimizer* steps (batches ÷ accumulation ×
    epochs) — the reference run's bug was counting samples.
    """
    if total_steps < 1:
        raise ValueError(f"total optimizer steps must be ≥ 1; got {total_steps}")
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"] = peak_lr
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=max(1, total_steps - warmup_steps), eta_min=peak_lr * final_ratio
    )
    if warmup_steps == 0:
        return cosine
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1e-2, end_factor=1.0, total_iters=warmup_steps)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])


def optimizer_steps(samples_per_rank: int, batch_size: int, grad_accum: int, epochs: int) -> int:
    """Optimizer steps of a run: ``ceil(ceil(samples/batch) / accum) × epochs`` (a partial batch counts)."""
    batches = math.ceil(samples_per_rank / batch_size)
    return math.ceil(batches / grad_accum) * epochs


def draw_noise(shape: tuple[int, ...], generator: Generators, noise_offset: float = 0.0) -> torch.Tensor:
    """Gaussian noise of ``shape`` (CPU), plus ``noise_offset`` times a per-sample, per-channel constant
    (Guttenberg 2023, the diffusers ``--noise_offset``), drawn in that order."""
    randn = partial(torch.randn, dtype=torch.float32)
    noise = draw(generator, shape, randn)
    if noise_offset:
        noise = noise + noise_offset * draw(generator, (shape[0], shape[1], 1, 1), randn)
    return noise


def training_noise(latents: torch.Tensor, generator: Generators, noise_offset: float = 0.0) -> torch.Tensor:
    """:func:`draw_noise` shaped like ``latents``, on their device."""
    return to_device(draw_noise(tuple(latents.shape), generator, noise_offset), latents.device)


@dataclass(frozen=True)
class LossDraws:
    """One micro-batch's random draws for the training loss, per sample from its CPU stream, in this order: the
    noise (with its offset), the noise level (integer timesteps, or σ for rectified flow), the input perturbation ξ
    (None without one). The loss is a pure function of these and the batch, so a static buffer can hold them (the
    trainer's CUDA-graph step)."""

    noise: torch.Tensor
    level: torch.Tensor
    xi: torch.Tensor | None = None

    def to(self, device: torch.device) -> LossDraws:
        """The draws on ``device`` (:func:`to_device`: no host synchronisation)."""
        xi = None if self.xi is None else to_device(self.xi, device)
        return LossDraws(to_device(self.noise, device), to_device(self.level, device), xi)

    def model_noise(self, input_perturbation: float) -> torch.Tensor:
        """The noise the model's input is built from: ``ε + γ·ξ`` (``ε`` without a perturbation)."""
        return self.noise if self.xi is None else self.noise + input_perturbation * self.xi


def draw_xi(shape: tuple[int, ...], generator: Generators, input_perturbation: float) -> torch.Tensor | None:
    """The input perturbation's ``ξ ~ N(0, 1)`` (CPU), or None (no draw) without one."""
    return draw(generator, shape, partial(torch.randn, dtype=torch.float32)) if input_perturbation else None


def draw_denoising(
    shape: tuple[int, ...],
    num_train_timesteps: int,
    generator: Generators,
    noise_offset: float = 0.0,
    logit_normal: tuple[float, float] | None = None,
    input_perturbation: float = 0.0,
) -> LossDraws:
    """:func:`denoising_loss`'s draws for latents of ``shape``: noise, offset, timestep, ξ (CPU)."""
    noise = draw_noise(shape, generator, noise_offset)
    timesteps = sample_timesteps(shape[0], num_train_timesteps, generator, logit_normal)
    return LossDraws(noise, timesteps, draw_xi(shape, generator, input_perturbation))


def denoising_loss(
    unet: torch.nn.Module,
    scheduler: DDPMScheduler,
    latents: torch.Tensor,
    cond: torch.Tensor,
    generator: Generators,
    min_snr_gamma: float | None,
    noise_offset: float = 0.0,
    logit_normal: tuple[float, float] | None = None,
    input_perturbation: float = 0.0,
    reduce: bool = True,
) -> torch.Tensor:
    """One micro-batch's loss: noise the latents at random timesteps, predict, Min-SNR-weighted MSE (per
    sample when not ``reduce``: the trainer's sample ledger keeps each sample's loss).

    ``noise_offset`` (:func:`training_noise`): without it the scaled-linear schedule leaks the latents'
    low-frequency content even at t≈999, so the model learns global colour from the noisy input
    instead of from the prompt. Timesteps uniformly, or logit-normal with ``logit_normal = (mean, std)``
    (:func:`sample_timesteps`). ``input_perturbation`` γ (Ning et al. 2023, diffusers
    ``--input_perturbation``): the UNet's input is noised with ``noise + γ·ξ``, the target keeps ``noise``.
    Draws per sample, in this order: noise, offset, timestep, ξ — all from the CPU ``generator``
    (:func:`draw_denoising`; the loss given them: :func:`denoising_loss_from`).
    """
    T = scheduler.config.num_train_timesteps
    draws = draw_denoising(tuple(latents.shape), T, generator, noise_offset, logit_normal, input_perturbation)
    return denoising_loss_from(unet, scheduler, latents, cond, draws.to(latents.device), min_snr_gamma,
                               input_perturbation, reduce)  # fmt: skip


def denoising_loss_from(
    unet: torch.nn.Module,
    scheduler: DDPMScheduler,
    latents: torch.Tensor,
    cond: torch.Tensor,
    draws: LossDraws,
    min_snr_gamma: float | None,
    input_perturbation: float = 0.0,
    reduce: bool = True,
) -> torch.Tensor:
    """:func:`denoising_loss` given its draws (on the latents' device): device work only, no host read."""
    timesteps = draws.level
    noisy = scheduler.add_noise(latents, draws.model_noise(input_perturbation), timesteps)
    pred = family_of(unet).predict(unet, noisy, timesteps, cond)
    target = training_target(scheduler, latents, draws.noise, timesteps)
    return diffusion_loss(pred, target, min_snr_weights(scheduler, timesteps, min_snr_gamma), reduce)


def ema_decay(step: int, peak: float) -> float:
    """EMA decay at optimizer step ``step`` (1-based): ``min(peak, (1 + step) / (10 + step))``.

    The warm-up of CompVis' ``LitEma`` (which trained SD 1.x; it counts the update being made) and of
    diffusers' ``EMAModel`` without ``use_ema_warmup`` (which counts from 0 and copies at its first
    update; ``update_after_step=-1`` shifts it onto this one). Step 1: 2/11; 0.9999 from step 89,990.
    """
    return min(peak, (1 + step) / (10 + step))


class TrainingEMA(EMAModel):
    """diffusers' ``EMAModel`` with :func:`ema_decay`, updated every ``every`` optimizer steps, on any device.

    An update after ``every`` optimizer steps applies the product of their per-step decays — for a
    constant decay ``d`` that is ``d**every``, the decay of ``every`` single-step updates towards the
    same weights (the weights in between are skipped, which is the saving). ``optimization_step``
    counts updates, so update ``n`` covers optimizer steps ``(n-1)·every+1 … n·every``; with
    ``every=1`` this is exactly ``EMAModel(update_after_step=-1)``.

    The shadow weights may live on another device than the model's (``to("cpu")``): each update
    copies the live weights there first.
    """

    def __init__(self, parameters, decay: float, every: int = 1, **kwargs):
        if every < 1:
            raise ValueError(f"EMA update interval must be ≥ 1; got {every}")
        super().__init__(parameters, decay=decay, update_after_step=-1, **kwargs)
        self.every = every

    def get_decay(self, optimization_step: int) -> float:
        """Decay of update number ``optimization_step`` (1-based)."""
        d = 1.0
        for step in range((optimization_step - 1) * self.every + 1, optimization_step * self.every + 1):
            d *= ema_decay(step, self.decay)
        return d

    @torch.no_grad()
    def step(self, parameters) -> None:
        """One EMA update towards ``parameters`` (copied to the shadow weights' device if elsewhere)."""
        parameters = list(parameters)
        home = self.shadow_params[0].device if self.shadow_params else None
        if parameters and parameters[0].device != home:
            parameters = [p.detach().to(home).requires_grad_(p.requires_grad) for p in parameters]
        super().step(parameters)
