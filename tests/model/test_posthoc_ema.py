"""Post-hoc EMA maths: the power-function update and EDM2's rebuild of another σ_rel from snapshots."""

import pytest
import torch

from model.posthoc_ema import PowerEMAs, combine, gamma_of, power_beta, synthesis_coefficients

STEPS, SNAPSHOTS = 400, 8


def _tracked(sigma_rels):
    """A 16-dim random walk with drift tracked by power EMAs of ``sigma_rels``; snapshots of the first two every
    STEPS / SNAPSHOTS steps as (step, gamma, tensors), the tracked EMAs and the final live weights."""
    gen = torch.Generator().manual_seed(0)
    theta, walk = torch.nn.Parameter(torch.zeros(16)), torch.zeros(16)
    emas = PowerEMAs([theta], sigma_rels, torch.device("cpu"))
    snaps = []
    for t in range(1, STEPS + 1):
        walk += 0.1 * torch.randn(16, generator=gen)
        theta.data.copy_(walk + 0.01 * t)
        emas.update([theta], t)
        if t % (STEPS // SNAPSHOTS) == 0:
            snaps += [(t, g, [s.clone() for s in sh]) for g, sh in zip(emas.gammas[:2], emas.shadows[:2], strict=True)]
    return snaps, emas, theta.data


def _rebuild(snaps, sigma_rel):
    c = synthesis_coefficients([s for s, _, _ in snaps], [g for _, g, _ in snaps], STEPS, sigma_rel)
    return combine((ci, ts) for ci, (_, _, ts) in zip(c, snaps, strict=True))[0]


def test_power_ema_is_the_gamma_weighted_average_of_the_steps():
    gamma = gamma_of(0.1)
    assert gamma == pytest.approx(6.9372, abs=1e-4) and power_beta(1, gamma) == 0.0
    theta = torch.nn.Parameter(torch.zeros(1))
    ema = PowerEMAs([theta], [0.1], torch.device("cpu"))
    for t in range(1, 51):
        theta.data.fill_(float(t))
        ema.update([theta], t)
    weights = torch.tensor([float(t) for t in range(1, 51)], dtype=torch.float64)
    # the recursion's closed form: step τ weighs Π_{s>τ} β_s · (1 − β_τ)
    coef = [(1 - power_beta(t, gamma)) * torch.prod(torch.tensor([power_beta(s, gamma) for s in range(t + 1, 51)],
            dtype=torch.float64)).item() for t in range(1, 51)]  # fmt: skip
    assert ema.shadows[0][0].item() == pytest.approx(float((weights * torch.tensor(coef)).sum()), rel=1e-5)
    assert sum(coef) == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match="sigma_rel must be in"):
        gamma_of(0.3)


def test_a_stored_profile_is_rebuilt_exactly_and_others_closely():
    snaps, emas, live = _tracked([0.05, 0.10, 0.075, 0.15])
    assert (_rebuild(snaps, 0.10) - emas.shadows[1][0]).abs().max() < 1e-6  # a snapshot itself: coefficient 1
    for k, sigma in ((2, 0.075), (3, 0.15)):  # between and beyond the stored ones: measured 0.8 % and 1.4 %
        reference = emas.shadows[k][0]
        gap = (reference - live).abs().max()
        assert (_rebuild(snaps, sigma) - reference).abs().max() < 0.02 * gap, sigma


def test_the_state_round_trips_and_refuses_other_profiles():
    theta = torch.nn.Parameter(torch.arange(4.0))
    a = PowerEMAs([theta], [0.05, 0.1], torch.device("cpu"))
    a.update([theta * 0 + 1], 3)
    b = PowerEMAs([theta], [0.05, 0.1], torch.device("cpu"))
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a.shadows, b.shadows, strict=True))
    with pytest.raises(ValueError, match="tracks σ_rel"):
        PowerEMAs([theta], [0.05, 0.2], torch.device("cpu")).load_state_dict(a.state_dict())
