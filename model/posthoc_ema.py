"""Post-hoc EMA (Karras et al. 2024, EDM2): power-function EMAs tracked while training, rebuilt afterwards at any
length from a few stored snapshots. Pure torch; no I/O.

A power-function EMA with exponent γ averages the weights seen so far with weights ``∝ τ^γ`` (step τ ≤ t): its
update at optimizer step t (1-based) is ``θ̂ ← β·θ̂ + (1 − β)·θ`` with ``β = (1 − 1/t)^(γ+1)``, so its length
grows with training instead of being fixed as a classic decay's is. Its relative width ``σ_rel`` (the profile's
standard deviation over its length) names it: EDM2 tracks σ_rel 0.05 and 0.10 and finds the best between ~0.02
and ~0.2 afterwards. Any profile ``(t_r, γ_r)`` is approximated by a linear combination of the stored
snapshots ``(t_i, γ_i)`` whose coefficients minimise the L2 distance between the profiles (EDM2's Algorithm 3).
The profile maths (``sigma_rel_to_gamma``, ``solve_weights``) is ema-pytorch's; its ``PostHocEMA`` keeps its own
checkpoint folder with ``torch.save``, so the snapshots, their resume and their files are this project's
(:mod:`sdforge.training.posthoc`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from ema_pytorch.post_hoc_ema import sigma_rel_to_gamma, solve_weights

SIGMA_REL_MAX = (1 / 12) ** 0.5
"""σ_rel of the uniform average (γ = 0): a power-function EMA is never wider."""


def gamma_of(sigma_rel: float) -> float:
    """The exponent γ of the power-function EMA of relative width ``sigma_rel`` (0 < σ_rel < 0.2887)."""
    if not 0 < sigma_rel < SIGMA_REL_MAX:
        raise ValueError(f"sigma_rel must be in (0, {SIGMA_REL_MAX:.4f}); got {sigma_rel}")
    return float(sigma_rel_to_gamma(sigma_rel))


def power_beta(step: int, gamma: float) -> float:
    """The decay of update number ``step`` (1-based): ``(1 − 1/step)^(γ+1)`` (0 at step 1: a copy)."""
    return (1.0 - 1.0 / step) ** (gamma + 1.0)


class PowerEMAs:
    """One power-function EMA of ``params`` per σ_rel, on ``device`` (fp32), updated after each optimizer step."""

    def __init__(self, params: Iterable[torch.nn.Parameter], sigma_rels: list[float], device: torch.device):
        params = list(params)
        self.sigma_rels = list(sigma_rels)
        self.gammas = [gamma_of(s) for s in self.sigma_rels]
        self.shadows = [[p.detach().to(device, torch.float32, copy=True) for p in params] for _ in self.gammas]

    @torch.no_grad()
    def update(self, params: Iterable[torch.nn.Parameter], step: int) -> None:
        """Move every EMA towards ``params`` with its :func:`power_beta` of optimizer step ``step``."""
        params = list(params)
        for gamma, shadow in zip(self.gammas, self.shadows, strict=True):
            weight = 1.0 - power_beta(step, gamma)
            for s, p in zip(shadow, params, strict=True):
                s.lerp_(p.detach().to(s.device, torch.float32), weight)

    def state_dict(self) -> dict:
        return {"sigma_rels": self.sigma_rels, "shadows": self.shadows}

    def load_state_dict(self, state: dict) -> None:
        if list(state["sigma_rels"]) != self.sigma_rels:
            raise ValueError(f"post-hoc EMA state tracks σ_rel {state['sigma_rels']}, not {self.sigma_rels}")
        for mine, saved in zip(self.shadows, state["shadows"], strict=True):
            for m, s in zip(mine, saved, strict=True):
                m.copy_(s)


def synthesis_coefficients(
    snapshot_steps: list[int], snapshot_gammas: list[float], step: int, sigma_rel: float
) -> list[float]:
    """The coefficient of each snapshot ``(t_i, γ_i)`` in the least-squares rebuild of the σ_rel profile at
    optimizer step ``step`` (EDM2 Algorithm 3; float64 solve)."""
    weights = solve_weights(
        torch.tensor(snapshot_steps, dtype=torch.float64),
        torch.tensor(snapshot_gammas, dtype=torch.float64),
        torch.tensor([step], dtype=torch.float64),
        torch.tensor([gamma_of(sigma_rel)], dtype=torch.float64),
    )
    return weights.squeeze(-1).tolist()


def combine(snapshots: Iterable[tuple[float, list[torch.Tensor]]]) -> list[torch.Tensor]:
    """``Σ c_i · snapshot_i`` over ``(c_i, tensors_i)`` pairs (float64 accumulation, one snapshot at a time)."""
    total: list[torch.Tensor] | None = None
    for coefficient, tensors in snapshots:
        if total is None:
            total = [torch.zeros_like(t, dtype=torch.float64) for t in tensors]
        for acc, t in zip(total, tensors, strict=True):
            acc.add_(t.double(), alpha=coefficient)
    if total is None:
        raise ValueError("no snapshot to combine")
    return [t.float() for t in total]
