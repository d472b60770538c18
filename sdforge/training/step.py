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

from model.diffusion import cfg_dropout, denoising_loss, part_dropout, to_device
from model.flow_matching import flow_matching_loss
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


class EpochReader:
    """This rank's micro-batches of ``epoch`` in plan order, read from the job's progress in it onward."""

    def __init__(self, job, epoch: int):
        self.batches = job.plan.rank_batches(job.data, epoch, job.dist.rank)
        self.captions = job.caption_choice(epoch)
        self.steps = len(self.batches) // job.plan.split.accum
        start = job.state.progress.batch * job.plan.split.accum
        self._reader = iter_batches(job.data, self.batches, start, self.captions)

    def next_micro_batch(self) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """The next micro-batch: its index positions, latents and token ids."""
        b, latents, input_ids = next(self._reader)
        return self.batches[b], latents, input_ids


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
        batch_positions, latents, input_ids = reader.next_micro_batch()
        data_wait += time.perf_counter() - t
        last = k == split.accum - 1
        losses.append(micro_step(job, latents, input_ids, seeds[split.part(k, rank)], 1.0 / split.accum, sync=last))
        positions.append(batch_positions)
    state.progress.step += 1
    job.model.reduce_outside_gradients()
    grad_norm = job.optim.step(state.progress.step)
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


def micro_step(job, latents: torch.Tensor, input_ids: torch.Tensor, seeds: torch.Tensor, scale: float, sync: bool):
    """Forward + backward one micro-batch (sample ``i``'s randomness from ``seeds[i]``); each sample's loss, fp32,
    detached, on the device (read once per step by :func:`train_step`)."""
    dev = job.dist.device
    cond = job.conditioning.encode(input_ids)
    gens = part_generators(seeds)
    cond = cfg_dropout(cond, job.conditioning.uncond, job.phase.cfg_dropout, gens)
    cond = part_dropout(cond, job.conditioning.uncond, job.caption_parts, gens)
    bf16 = uses_bf16_autocast(dev, job.cfg.mixed_precision)
    with job.model.no_sync(sync), attention_context(job.attention):  # no_sync() is single-use: one context
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            if job.phase.distill is not None:  # the teacher's target instead of the denoising one
                per_sample = distill_loss(job, to_device(latents, dev), cond, gens)
            else:
                per_sample = phase_loss(job.phase, job.objective, job.model.forward_module,
                                        job.conditioning.scheduler, to_device(latents, dev), cond, gens)  # fmt: skip
            loss = per_sample.mean()
        (loss * scale).backward()
    return per_sample.detach().float()


def phase_loss(phase: Phase, objective: str, model, scheduler, latents: torch.Tensor, cond: torch.Tensor, gens):
    """One micro-batch's per-sample losses under the phase's objective and options (timestep sampling, noise
    offset, input perturbation, flow shift, Min-SNR-γ): :func:`model.diffusion.denoising_loss` or
    :func:`model.flow_matching.flow_matching_loss`."""
    logit_normal = tuple(phase.logit_normal) if phase.timestep_sampling == "logit_normal" else None
    if objective == "flow_matching":
        return flow_matching_loss(
            model, latents, cond, gens,
            num_train_timesteps=scheduler.config.num_train_timesteps, logit_normal=logit_normal,
            shift=phase.flow_shift, noise_offset=phase.noise_offset,
            input_perturbation=phase.input_perturbation, reduce=False,
        )  # fmt: skip
    return denoising_loss(
        model, scheduler, latents, cond, gens, phase.min_snr_gamma, phase.noise_offset, logit_normal,
        phase.input_perturbation, reduce=False,
    )  # fmt: skip
