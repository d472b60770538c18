"""Latent consistency distillation (LCM, Luo et al. 2023; LCM-LoRA): the teacher's solver grid, the consistency
function's parametrisation, and one micro-batch's loss. Pure torch + diffusers' schedule; no I/O.

A sample on the teacher's probability-flow ODE is ``x_t = a_t·x0 + b_t·ε``: diffusion ``a = √ᾱ_t``, ``b = √(1−ᾱ_t)``
(ε or v prediction); flow matching ``a = 1 − σ``, ``b = σ`` (velocity ``v = ε − x0``). The student's consistency
function maps any point of a trajectory to its origin:

- diffusion: ``f(x, t) = c_skip(t)·x + c_out(t)·x0̂(x, t)`` with LCM's boundary scalings at ``t·timestep_scaling``
  (what diffusers' ``LCMScheduler`` applies when sampling);
- flow matching: ``f(x, σ) = x0̂ = x − σ·v``, which is ``x`` at σ = 0 by construction (diffusers'
  ``FlowMatchLCMScheduler`` takes the same value).

Training (per sample): a grid point ``k`` of ``num_points`` (diffusion: DDIM timesteps ``(k+1)·T/N − 1``; flow:
``σ = shift((k+1)/N)``), ``x_k`` from the latents and fresh noise, the teacher's classifier-free-guided DDIM step
(for flow matching that is the Euler step) to the previous point ``k−1`` (``t = 0`` / ``σ = 0`` below the grid),
and the loss between the student's ``f(x_k)`` and ``f(x_{k−1})`` of the same student without gradient (LCM-LoRA
keeps no separate target network).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from model.diffusion import Generators, check_prediction_type, draw, to_device, training_noise
from model.flow_matching import shift_sigmas

Denoiser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(x, timestep input, text condition) -> model output``: a UNet call (student, frozen teacher, or target)."""

SIGMA_DATA = 0.5
"""LCM's σ_data in the boundary scalings (diffusers' ``LCMScheduler``)."""


def _column(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``[B]`` values shaped to broadcast over ``like`` ``[B, C, h, w]`` (its device, fp32)."""
    return values.to(device=like.device, dtype=torch.float32).view(-1, *([1] * (like.ndim - 1)))


@dataclass(frozen=True)
class GridPoint:
    """Per-sample quantities of one point of the solver grid (each ``[B]``)."""

    model_t: torch.Tensor
    """The UNet's timestep input: the integer timestep (diffusion) or ``σ·num_train_timesteps`` (flow)."""
    a: torch.Tensor
    b: torch.Tensor
    c_skip: torch.Tensor
    c_out: torch.Tensor


class SolverGrid:
    """The teacher's solver grid for one objective, and the consistency parametrisation on it."""

    def __init__(
        self,
        objective: str,
        num_points: int,
        num_train_timesteps: int,
        *,
        alphas_cumprod: torch.Tensor | None = None,
        prediction_type: str = "epsilon",
        timestep_scaling: float = 10.0,
        flow_shift: float = 1.0,
    ):
        if objective not in ("diffusion", "flow_matching"):
            raise ValueError(f"objective must be diffusion or flow_matching; got {objective!r}")
        if not 2 <= num_points <= num_train_timesteps:
            raise ValueError(f"num_ddim_timesteps must be in [2, {num_train_timesteps}]; got {num_points}")
        if objective == "diffusion" and alphas_cumprod is None:
            raise ValueError("a diffusion grid needs the training schedule's alphas_cumprod")
        self.objective, self.num_points, self.num_train_timesteps = objective, num_points, num_train_timesteps
        self.prediction_type = check_prediction_type(prediction_type) if objective == "diffusion" else "flow"
        self.alphas_cumprod = None if alphas_cumprod is None else alphas_cumprod.double().cpu()
        self.timestep_scaling, self.flow_shift = timestep_scaling, flow_shift
        self.skip = num_train_timesteps // num_points

    def point(self, index: torch.Tensor) -> GridPoint:
        """Grid point ``index`` (``[B]`` long, ``-1`` = the data end: t = 0 / σ = 0)."""
        if self.objective == "flow_matching":
            sigma = shift_sigmas((index + 1).double() / self.num_points, self.flow_shift)
            zero = torch.zeros_like(sigma)
            return GridPoint(
                (sigma * self.num_train_timesteps).float(), (1 - sigma).float(), sigma.float(), zero.float(),
                torch.ones_like(sigma).float(),
            )  # fmt: skip
        t = ((index + 1) * self.skip - 1).clamp(min=0)
        alpha_bar = self.alphas_cumprod[t]
        scaled = t.double() * self.timestep_scaling
        c_skip = SIGMA_DATA**2 / (scaled**2 + SIGMA_DATA**2)
        c_out = scaled / (scaled**2 + SIGMA_DATA**2) ** 0.5
        return GridPoint(t, alpha_bar.sqrt().float(), (1 - alpha_bar).sqrt().float(), c_skip.float(), c_out.float())

    def data_and_noise(self, out: torch.Tensor, x: torch.Tensor, p: GridPoint) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x0̂, ε̂)`` implied by model output ``out`` at ``x`` (fp32)."""
        out, x = out.float(), x.float()
        a, b = _column(p.a, x), _column(p.b, x)
        if self.prediction_type == "flow":
            return x - b * out, x + a * out
        if self.prediction_type == "epsilon":
            return (x - b * out) / a, out
        return a * x - b * out, a * out + b * x

    def consistency(self, out: torch.Tensor, x: torch.Tensor, p: GridPoint) -> torch.Tensor:
        """The consistency function's value ``c_skip·x + c_out·x0̂`` (fp32)."""
        x0, _ = self.data_and_noise(out, x, p)
        return _column(p.c_skip, x) * x.float() + _column(p.c_out, x) * x0

    def noisy(self, latents: torch.Tensor, noise: torch.Tensor, p: GridPoint) -> torch.Tensor:
        """``a·x0 + b·ε`` at ``p``."""
        return _column(p.a, latents) * latents.float() + _column(p.b, latents) * noise.float()


@dataclass(frozen=True)
class DistillDraws:
    """One micro-batch's random choices, drawn per sample (noise, grid point, guidance) from its own stream."""

    noise: torch.Tensor
    index: torch.Tensor
    guidance: torch.Tensor


def draw_distill(
    latents: torch.Tensor, gens: Generators, num_points: int, w_range: tuple[float, float]
) -> DistillDraws:
    """Per sample, in this order: its noise, its grid point (uniform over ``num_points``), its guidance scale
    (uniform in ``w_range``) — all from the CPU generators, so a sample's draws do not depend on its batch."""
    noise = training_noise(latents, gens)
    batch = latents.shape[0]
    index = draw(gens, (batch,), partial(torch.randint, 0, num_points, dtype=torch.long))
    u = draw(gens, (batch,), partial(torch.rand, dtype=torch.float32))
    return DistillDraws(noise, index, w_range[0] + (w_range[1] - w_range[0]) * u)


def per_sample_loss(pred: torch.Tensor, target: torch.Tensor, kind: str, huber_c: float) -> torch.Tensor:
    """``[B]``: mean over ``C, h, w`` of ``(pred − target)²`` (``l2``) or ``sqrt(d² + c²) − c`` (``huber``)."""
    diff = pred.float() - target.float()
    if kind == "l2":
        elementwise = diff.pow(2)
    elif kind == "huber":
        elementwise = torch.sqrt(diff.pow(2) + huber_c**2) - huber_c
    else:
        raise ValueError(f"distill loss must be l2 or huber; got {kind!r}")
    return elementwise.mean(dim=tuple(range(1, pred.ndim)))


def teacher_step(
    teacher: Denoiser, grid: SolverGrid, x: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor,
    index: torch.Tensor, guidance: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The frozen teacher's guided DDIM step from grid point ``index`` to the one below it (fp32).

    One batched call on ``[uncond; cond]``; guidance ``w`` per sample on ``x0̂`` and ``ε̂`` alike: ``u + w·(c − u)``
    (for flow matching this is the Euler step ``x + (σ' − σ)·v``)."""
    here, below = grid.point(index), grid.point(index - 1)
    t = to_device(here.model_t, x.device)
    both = teacher(torch.cat([x, x]), torch.cat([t, t]), torch.cat([uncond, cond]))
    out_u, out_c = both.float().chunk(2)
    x0_u, eps_u = grid.data_and_noise(out_u, x, here)
    x0_c, eps_c = grid.data_and_noise(out_c, x, here)
    w = _column(guidance, x)
    x0, eps = x0_u + w * (x0_c - x0_u), eps_u + w * (eps_c - eps_u)
    return _column(below.a, x) * x0 + _column(below.b, x) * eps


def lcm_loss(
    student: Denoiser,
    teacher: Denoiser,
    target: Denoiser,
    grid: SolverGrid,
    latents: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor,
    gens: Generators,
    *,
    w_range: tuple[float, float],
    loss: str = "huber",
    huber_c: float = 0.001,
) -> torch.Tensor:
    """One micro-batch's per-sample consistency-distillation losses ``[B]`` (fp32, with the student's graph).

    ``uncond`` ``[1, L, D]`` is the empty prompt's embedding (the teacher's unconditional branch). The teacher and
    the target run without gradient; only ``student`` carries one."""
    draws = draw_distill(latents, gens, grid.num_points, w_range)
    here, below = grid.point(draws.index), grid.point(draws.index - 1)
    x = grid.noisy(latents, to_device(draws.noise, latents.device), here).to(latents.dtype)
    uncond = uncond.to(cond.dtype).expand_as(cond)
    with torch.no_grad():
        x_prev = teacher_step(teacher, grid, x, cond, uncond, draws.index, draws.guidance).to(latents.dtype)
        wanted = grid.consistency(target(x_prev, to_device(below.model_t, x.device), cond), x_prev, below)
    pred = grid.consistency(student(x, to_device(here.model_t, x.device), cond), x, here)
    return per_sample_loss(pred, wanted, loss, huber_c)
