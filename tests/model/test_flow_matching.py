"""Flow matching maths: the interpolation and its velocity target, σ sampling, the shift, the Euler sampler."""

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from model.flow_matching import flow_matching_loss, interpolate, sample_sigmas, shift_sigmas
from model.sampler import flow_euler_scheduler


class Spy(torch.nn.Module):
    """A UNet stand-in that records its input and timestep and predicts ``out``."""

    def __init__(self, out: torch.Tensor | None = None):
        super().__init__()
        self.out, self.seen = out, {}

    denoiser_family = "unet"  # called like a UNet (model.denoisers.family_of)

    def forward(self, x, t, encoder_hidden_states):
        self.seen.update(x=x, t=t)
        return type("Out", (), {"sample": self.out if self.out is not None else torch.zeros_like(x)})()


def test_interpolation_is_data_at_zero_and_noise_at_one():
    x0, eps = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    sigma = torch.tensor([0.0, 0.25, 1.0])
    x = interpolate(x0, eps, sigma)
    assert torch.equal(x[0], x0[0]) and torch.equal(x[2], eps[2])
    assert torch.allclose(x[1], 0.75 * x0[1] + 0.25 * eps[1])


def test_loss_is_zero_exactly_for_the_true_velocity_and_the_unet_sees_sigma_times_T():
    gen = torch.Generator().manual_seed(3)
    latents = torch.randn(4, 4, 8, 8)
    # replay the draws: noise, then sigma (no offset, no perturbation)
    replay = torch.Generator().manual_seed(3)
    noise = torch.randn(latents.shape, generator=replay)
    sigma = torch.rand(4, generator=replay)
    spy = Spy(noise - latents)
    loss = flow_matching_loss(spy, latents, torch.zeros(4, 1, 1), gen, num_train_timesteps=1000)
    assert float(loss) == 0.0
    assert torch.allclose(spy.seen["t"], sigma * 1000)
    assert torch.allclose(spy.seen["x"], interpolate(latents, noise, sigma))


def test_input_perturbation_changes_the_input_but_not_the_target():
    latents = torch.randn(64, 4, 8, 8)
    replay = torch.Generator().manual_seed(0)
    noise = torch.randn(latents.shape, generator=replay)
    target = noise - latents
    plain, perturbed = Spy(target), Spy(target)
    loss_plain = flow_matching_loss(
        plain, latents, torch.zeros(1), torch.Generator().manual_seed(0), num_train_timesteps=1000
    )
    loss_pert = flow_matching_loss(
        perturbed,
        latents,
        torch.zeros(1),
        torch.Generator().manual_seed(0),
        num_train_timesteps=1000,
        input_perturbation=0.1,
    )
    assert float(loss_plain) == float(loss_pert) == 0.0  # same target: the true velocity of the unperturbed noise
    assert torch.equal(plain.seen["t"], perturbed.seen["t"])
    extra = (perturbed.seen["x"] - plain.seen["x"]) / plain.seen["t"].view(-1, 1, 1, 1) * 1000  # = γ·ξ
    assert 0.09 < float(extra.std()) < 0.11


@pytest.mark.parametrize(("mean", "share_above_half"), [(0.0, 0.5), (1.0, 0.8413), (-0.5, 0.3085)])
def test_logit_normal_sigmas_follow_the_sigmoid_of_a_normal(mean, share_above_half):
    sigma = sample_sigmas(20000, torch.Generator().manual_seed(0), (mean, 1.0))
    assert float(sigma.min()) > 0 and float(sigma.max()) < 1
    assert abs(float((sigma > 0.5).float().mean()) - share_above_half) < 0.01  # P(σ > ½) = Φ(mean)
    uniform = sample_sigmas(20000, torch.Generator().manual_seed(0))
    assert abs(float((uniform < 0.1).float().mean()) - 0.1) < 0.01


def test_shift_moves_sigmas_up_and_keeps_the_ends():
    s = torch.tensor([0.0, 0.25, 0.5, 1.0])
    assert torch.equal(shift_sigmas(s, 1.0), s)
    shifted = shift_sigmas(s, 3.0)
    assert shifted[0] == 0 and shifted[-1] == 1 and float(shifted[2]) == pytest.approx(0.75)
    assert bool((shifted[1:3] > s[1:3]).all())


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_the_exported_scheduler_takes_euler_steps(shift):
    scheduler = flow_euler_scheduler(1000, shift)
    scheduler.set_timesteps(6)
    assert scheduler.init_noise_sigma == 1.0  # StableDiffusionPipeline scales the first latents by it
    sigmas = scheduler.sigmas
    assert float(sigmas[-1]) == 0.0
    eps, x0 = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(1, 4, 8, 8)

    def velocity(x, s):
        return eps - x0 + 0.1 * torch.sin(3 * x * s)  # a field that is not constant along the path

    x = y = eps.clone()
    for i, t in enumerate(scheduler.timesteps):
        x = scheduler.step(velocity(x, sigmas[i]), t, x).prev_sample
        y = y + (sigmas[i + 1] - sigmas[i]) * velocity(y, sigmas[i])  # Euler on dx/dσ = v
    assert float((x - y).abs().max()) < 1e-5
    # the same sigmas as diffusers' flow-matching Euler scheduler would use from σ = 0.999 (its σ grid, shifted)
    fm = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    fm.set_timesteps(sigmas=(1 - torch.linspace(0.001, 1, 7)[:-1]).tolist())
    assert torch.allclose(fm.sigmas, sigmas.float(), atol=1e-6)
