"""A distillation phase's loss (``phases.<p>.distill``, docs/ADAPTERS.md "Distillation"): the frozen teacher, the
student and the target are three calls of the one adapted UNet (:mod:`model.consistency`).

- teacher: the UNet with its adapter switched off (:func:`model.adapters.adapters_disabled`), no gradient — the
  phase's ``init_from`` weights, which the adapter phase keeps frozen;
- student: the adapted UNet through its DDP wrapper, with gradient (the only call that trains);
- target: the adapted UNet without gradient (LCM-LoRA's stop-gradient target; no target EMA).

One UNet in memory instead of a teacher copy: at SD1.5 size that saves 3.4 GB per rank.
"""

from __future__ import annotations

import torch

from model.adapters import adapters_disabled
from model.consistency import SolverGrid, lcm_loss
from sdforge.config import Phase


def solver_grid(phase: Phase, objective: str, scheduler) -> SolverGrid:
    """The teacher's solver grid of ``phase`` (its ``distill`` options) under ``objective`` and the training
    ``scheduler`` (DDPM: its ``alphas_cumprod`` and prediction type)."""
    spec = phase.distill
    return SolverGrid(
        objective,
        spec.num_ddim_timesteps,
        scheduler.config.num_train_timesteps,
        alphas_cumprod=scheduler.alphas_cumprod if objective == "diffusion" else None,
        prediction_type=scheduler.config.prediction_type,
        timestep_scaling=spec.timestep_scaling,
        flow_shift=phase.flow_shift,
    )


def distill_loss(job, latents: torch.Tensor, cond: torch.Tensor, gens) -> torch.Tensor:
    """Per-sample consistency-distillation losses of one micro-batch of ``job`` (a distill phase's TrainJob)."""
    spec, unet = job.phase.distill, job.model.unet
    student = job.model.forward_module

    def teacher(x, t, context):
        with adapters_disabled(unet):
            return unet(x, t, encoder_hidden_states=context).sample

    def target(x, t, context):
        return unet(x, t, encoder_hidden_states=context).sample

    def learner(x, t, context):
        return student(x, t, encoder_hidden_states=context).sample

    grid = solver_grid(job.phase, job.objective, job.conditioning.scheduler)
    return lcm_loss(
        learner, teacher, target, grid, latents, cond, job.conditioning.uncond, gens,
        w_range=(spec.w_min, spec.w_max), loss=spec.loss, huber_c=spec.huber_c,
    )  # fmt: skip
