"""One optimizer step, whole: ``split.accum`` micro-batches of this rank's part of the global batch forward and
backward (every sample's noise, timestep and CFG drop from its own seed), then clip, step, schedule and EMA.

The micro-batches come from an :class:`EpochReader` (this rank's batches of the epoch, read from the resume
point on); the result is a :class:`StepReport` that the hooks read (:mod:`sdforge.training.hooks`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from model.diffusion import (
    LossDraws,
    denoising_loss_from,
    draw_denoising,
    drop_mask,
    dropped_condition,
    part_drop_mask,
    part_regions,
    to_device,
)
from model.flow_matching import draw_flow, flow_matching_loss_from
from model.precision import uses_bf16_autocast
from model.speed import attention_context
from sdforge.config import Phase
from sdforge.latents.loader import iter_batches
from sdforge.training.distillation import distill_loss
from sdforge.training.distributed import part_generators, step_seeds


@dataclass
class StepReport:
    """What one optimizer step did on this rank; hooks add the step's agreement and artifacts."""

    step: int
    """Optimizer steps done, this one included."""
    epoch: int
    loss: float
    """Mean loss over this rank's samples of the step."""
    grad_norm: float
    lr: float
    """The LR of the next step (the schedule has moved on)."""
    micro: list[tuple[np.ndarray, torch.Tensor]]
    """Per micro-batch: its index positions and each sample's loss (CPU)."""
    captions: np.ndarray | None
    step_time_s: float
    data_wait_s: float
    agreed: object = None
    """The step's all-reduce (:class:`sdforge.training.preemption.StepAgreement`), set by the preemption hook."""
    busy: bool = False
    """A hook works long after this step (validation): the other ranks wait for it in the next step."""
    artifacts: list = field(default_factory=list)
    """``(file, artifact folder)`` pairs a hook wrote for the tracking hook to log."""
    metrics: dict = field(default_factory=dict)
    """Figures a hook measured at this step (the validation loss): in the step record and MLflow at this step."""

    @property
    def per_sample(self) -> torch.Tensor:
        return torch.cat([losses for _, losses in self.micro])

    @property
    def positions(self) -> np.ndarray:
        return np.concatenate([positions for positions, _ in self.micro])


MaybeTensor = torch.Tensor | None


class EpochReader:
    """This rank's micro-batches of ``epoch`` in plan order, read from the job's progress in it onward."""

    def __init__(self, job, epoch: int):
        self.batches = job.plan.rank_batches(job.data, epoch, job.dist.rank)
        self.captions = job.caption_choice(epoch)
        self.steps = len(self.batches) // job.plan.split.accum
        start = job.state.progress.batch * job.plan.split.accum
        self._reader = iter_batches(job.data, self.batches, start, self.captions)
        self._controls, self._sizes = job.controls, job.sizes

    def next_micro_batch(self) -> tuple[np.ndarray, torch.Tensor, torch.Tensor, MaybeTensor, MaybeTensor]:
        """The next micro-batch: its index positions, latents, token ids, (a ControlNet phase's) conditioning
        images and (a family with micro-conditioning's) image sizes."""
        b, latents, input_ids = next(self._reader)
        control = None if self._controls is None else self._controls.gather(self.batches[b])
        sizes = None if self._sizes is None else self._sizes.gather(self.batches[b])
        return self.batches[b], latents, input_ids, control, sizes


def train_step(job, reader: EpochReader) -> StepReport:
    """One optimizer step of ``job`` (:class:`sdforge.training.job.TrainJob`) on the reader's next micro-batches;
    gradients are all-reduced on the last micro-batch only.

    No host synchronisation between its micro-batches: the per-sample losses, their finiteness and the gradient
    norm stay on the device until one read after the optimizer step. A non-finite loss then stops the run
    before any hook — so before the next checkpoint is written (the last good one is kept)."""
    split, rank, state = job.plan.split, job.dist.rank, job.state
    seeds = step_seeds(state.generator, split.global_batch)
    t0, data_wait, positions, losses = time.perf_counter(), 0.0, [], []
    for k in range(split.accum):
        t = time.perf_counter()
        batch_positions, latents, input_ids, control, sizes = reader.next_micro_batch()
        data_wait += time.perf_counter() - t
        last = k == split.accum - 1
        micro = job.static.micro_step if job.static is not None else micro_step
        losses.append(micro(job, latents, input_ids, seeds[split.part(k, rank)], 1.0 / split.accum, sync=last,
                            control=control, sizes=sizes))  # fmt: skip
        positions.append(batch_positions)
    state.progress.step += 1
    grad_norm = optimizer_step(job, state.progress.step)
    per_sample, grad_norm = _read_step(torch.cat(losses), grad_norm)  # the step's one device → host read
    if not torch.isfinite(per_sample).all():
        raise FloatingPointError(
            f"train@{job.phase_name}: non-finite loss at step {state.progress.step} "
            f"({int((~torch.isfinite(per_sample)).sum())} of {per_sample.numel()} samples); stopping (the last "
            "good checkpoint is kept). Lower the LR or check the latents."
        )
    state.progress.batch += 1
    loss = float(per_sample.mean())
    state.losses.append(loss)
    micro = list(zip(positions, per_sample.split([len(p) for p in positions]), strict=True))
    return StepReport(state.progress.step, state.progress.epoch, loss, grad_norm, job.optim.lr(), micro,
                      reader.captions, time.perf_counter() - t0, data_wait)  # fmt: skip


def _read_step(per_sample: torch.Tensor, grad_norm: torch.Tensor) -> tuple[torch.Tensor, float]:
    """The step's per-sample losses (CPU, fp32) and gradient norm, in one copy from the device."""
    both = torch.cat([per_sample, grad_norm.detach().float().reshape(1).to(per_sample.device)]).cpu()
    return both[:-1], float(both[-1])


def optimizer_step(job, step: int) -> torch.Tensor:
    """Optimizer step number ``step`` after the step's micro-batches: the gradients DDP does not reduce, then
    :meth:`~sdforge.training.optimization.Optimization.step` (or the static step's); the gradient norm (device)."""
    if job.static is not None:
        return job.static.optimizer_step(job, step)
    job.model.reduce_outside_gradients()
    return job.optim.step(step)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch and every random choice its loss makes, drawn per sample from its own CPU stream before any
    device work (:func:`draw_micro`): what :func:`micro_loss` reads, so a static buffer can hold it
    (:mod:`sdforge.training.static_step`)."""

    latents: torch.Tensor
    input_ids: torch.Tensor
    drop: torch.Tensor
    """``[B]`` bool: the sample trains on the empty prompt (``phases.<p>.cfg_dropout``)."""
    part_drop: torch.Tensor
    """``[B, P]`` bool: the sample loses caption part ``p`` (``phases.<p>.caption_dropout``; P may be 0)."""
    draws: LossDraws | None
    """The loss's noise, level and ξ; None for a distillation phase (its draws are the teacher step's own)."""
    control: torch.Tensor | None = None
    """A ControlNet phase's conditioning images ``[B, 3, H, W]`` (None for any other phase)."""
    sizes: torch.Tensor | None = None
    """``[B, 6]`` each image's size and crop, for a family with micro-conditioning (SDXL's ``time_ids``)."""

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor, in a fixed order (a static buffer is copied into tensor by tensor)."""
        loss = [] if self.draws is None else [self.draws.noise, self.draws.level]
        xi = [] if self.draws is None or self.draws.xi is None else [self.draws.xi]
        side = [t for t in (self.control, self.sizes) if t is not None]
        return [self.latents, self.input_ids, self.drop, self.part_drop, *loss, *xi, *side]

    def to(self, device: torch.device) -> MicroBatch:
        """The micro-batch on ``device`` (:func:`~model.diffusion.to_device`: no host synchronisation)."""
        draws = None if self.draws is None else self.draws.to(device)
        control, sizes = (None if t is None else to_device(t, device) for t in (self.control, self.sizes))
        return MicroBatch(to_device(self.latents, device), to_device(self.input_ids, device),
                          to_device(self.drop, device), to_device(self.part_drop, device), draws, control,
                          sizes)  # fmt: skip


def draw_micro(job, latents: torch.Tensor, input_ids: torch.Tensor, gens, control=None, sizes=None) -> MicroBatch:
    """The micro-batch (``control``: a ControlNet phase's conditioning images; ``sizes``: the images' sizes for a
    family with micro-conditioning) with its draws from the per-sample
    streams ``gens``, in this order per sample: the CFG drop, each caption part's drop, then the loss's noise, level
    and ξ (:func:`phase_draws`; none for distillation)."""
    batch = latents.shape[0]
    drop = drop_mask(batch, job.phase.cfg_dropout, gens)
    part_drop = part_drop_mask(batch, job.caption_parts, gens)
    draws = None
    if job.phase.distill is None:
        draws = phase_draws(job.phase, job.objective, job.conditioning.scheduler, tuple(latents.shape), gens)
    return MicroBatch(latents, input_ids, drop, part_drop, draws, control, sizes)


def micro_step(job, latents: torch.Tensor, input_ids: torch.Tensor, seeds: torch.Tensor, scale: float, sync: bool,
               control: torch.Tensor | None = None, sizes: torch.Tensor | None = None):  # fmt: skip
    """Forward + backward one micro-batch (sample ``i``'s randomness from ``seeds[i]``; ``control``: a ControlNet
    phase's conditioning images); each sample's loss, fp32, detached, on the device (read once per step by
    :func:`train_step`)."""
    gens = part_generators(seeds)
    batch = draw_micro(job, latents, input_ids, gens, control, sizes).to(job.dist.device)
    return micro_loss(job, batch, scale, sync, gens)


def micro_loss(job, batch: MicroBatch, scale: float, sync: bool, gens=None, cast_cache: bool = True) -> torch.Tensor:
    """Forward + backward ``batch`` (on the device) scaled by ``scale``; each sample's loss, fp32, detached. Device
    work only when ``batch`` holds the loss's draws (``gens``: a distillation phase's streams, drawn from here).
    ``cast_cache``: autocast keeps each weight's bf16 copy for the forward (off inside a CUDA graph capture, as torch
    requires; the same values, recast)."""
    dev = job.dist.device
    cond = condition(job, batch)
    bf16 = uses_bf16_autocast(dev, job.cfg.mixed_precision)
    with job.model.no_sync(sync), attention_context(job.attention), job.model.controlled(batch.control):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=cast_cache):
            if batch.draws is None:  # distillation: the teacher's target instead of the denoising one
                per_sample = distill_loss(job, batch.latents, cond, gens)
            else:
                per_sample = phase_loss_from(job.phase, job.objective, job.model.forward_module,
                                             job.conditioning.scheduler, batch.latents, cond, batch.draws)  # fmt: skip
            loss = per_sample.mean()
        (loss * scale).backward()
    return per_sample.detach().float()


def condition(job, batch: MicroBatch) -> torch.Tensor:
    """The micro-batch's text conditioning with its CFG and caption-part drops applied, then its images' sizes
    written in (a family with micro-conditioning: a dropped prompt keeps them; device work only)."""
    uncond = job.conditioning.uncond
    cond = job.conditioning.encode(batch.input_ids)
    regions = caption_regions(list(job.caption_parts), tuple(cond.shape[1:]), cond.device)
    cond = dropped_condition(cond, uncond, batch.drop, batch.part_drop, regions)
    return cond if batch.sizes is None else job.family.sized(cond, batch.sizes)


_REGIONS: dict[str, torch.Tensor] = {}


def caption_regions(parts: list, shape: tuple[int, int], device: torch.device) -> torch.Tensor | None:
    """The caption parts' regions of a ``[L, D]`` condition on ``device``, built once per parts, shape and device (a
    host-to-device copy cannot be captured in a CUDA graph); None without parts."""
    if not parts:
        return None
    key = repr((parts, shape, device))  # a part's slices are not hashable before Python 3.12
    if key not in _REGIONS:
        _REGIONS[key] = part_regions(parts, shape).to(device)
    return _REGIONS[key]


def phase_draws(phase: Phase, objective: str, scheduler, shape: tuple[int, ...], gens) -> LossDraws:
    """One micro-batch's loss draws under the phase's options (timestep sampling, noise offset, input
    perturbation, flow shift): :func:`model.diffusion.draw_denoising` or :func:`model.flow_matching.draw_flow`."""
    logit_normal = tuple(phase.logit_normal) if phase.timestep_sampling == "logit_normal" else None
    if objective == "flow_matching":
        return draw_flow(shape, gens, logit_normal, phase.flow_shift, phase.noise_offset, phase.input_perturbation)
    return draw_denoising(shape, scheduler.config.num_train_timesteps, gens, phase.noise_offset, logit_normal,
                          phase.input_perturbation)  # fmt: skip


def phase_loss_from(phase: Phase, objective: str, model, scheduler, latents, cond, draws: LossDraws) -> torch.Tensor:
    """One micro-batch's per-sample losses given its draws (on the device), Min-SNR-γ as the phase says:
    :func:`model.diffusion.denoising_loss_from` or :func:`model.flow_matching.flow_matching_loss_from`."""
    if objective == "flow_matching":
        T = scheduler.config.num_train_timesteps
        return flow_matching_loss_from(model, latents, cond, draws, T, phase.input_perturbation, reduce=False)
    return denoising_loss_from(model, scheduler, latents, cond, draws, phase.min_snr_gamma,
                               phase.input_perturbation, reduce=False)  # fmt: skip


def phase_loss(phase: Phase, objective: str, model, scheduler, latents: torch.Tensor, cond: torch.Tensor, gens):
    """One micro-batch's per-sample losses under the phase's objective and options: :func:`phase_draws`, then
    :func:`phase_loss_from` on the latents' device."""
    draws = phase_draws(phase, objective, scheduler, tuple(latents.shape), gens)
    return phase_loss_from(phase, objective, model, scheduler, latents, cond, draws.to(latents.device))
