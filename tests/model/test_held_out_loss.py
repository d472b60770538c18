"""The validation loss's maths: fixed levels, the objective's target, no weighting."""

import pytest
import torch
from diffusers import DDPMScheduler

from model.held_out_loss import fixed_fractions, fixed_timesteps, held_out_losses


class Constant(torch.nn.Module):
    """A 'UNet' that predicts ``value`` everywhere and records the timesteps it was asked at."""

    def __init__(self, value: float):
        super().__init__()
        self.value, self.seen = value, []

    denoiser_family = "unet"  # called like a UNet (model.denoisers.family_of)

    def forward(self, x, t, encoder_hidden_states=None):
        self.seen.append(t.clone())
        return type("Out", (), {"sample": torch.full_like(x, self.value)})()


def test_fixed_levels_are_evenly_spaced_midpoints():
    assert fixed_fractions(4).tolist() == [0.125, 0.375, 0.625, 0.875]
    assert fixed_timesteps(fixed_fractions(8), 1000).tolist() == [62, 187, 312, 437, 562, 687, 812, 937]
    with pytest.raises(ValueError, match="at least one"):
        fixed_fractions(0)


def test_flow_matching_loss_is_the_mse_to_noise_minus_data_at_each_sigma():
    gen = torch.Generator().manual_seed(0)
    latents, noise = torch.randn(3, 4, 2, 2, generator=gen), torch.randn(3, 4, 2, 2, generator=gen)
    unet, sched = Constant(0.5), DDPMScheduler(num_train_timesteps=1000)
    losses = held_out_losses(unet, latents, None, noise, fixed_fractions(2), objective="flow_matching",
                             scheduler=sched)  # fmt: skip
    expected = ((0.5 - (noise - latents)) ** 2).mean(dim=(1, 2, 3))
    assert losses.shape == (3, 2)
    torch.testing.assert_close(losses[:, 0], expected)  # the target does not depend on σ
    torch.testing.assert_close(losses[:, 1], expected)
    assert [t.tolist() for t in unet.seen] == [[250.0] * 3, [750.0] * 3]  # σ · T, unshifted


def test_diffusion_loss_is_the_unweighted_mse_to_epsilon_at_fixed_timesteps():
    gen = torch.Generator().manual_seed(1)
    latents, noise = torch.randn(2, 4, 2, 2, generator=gen), torch.randn(2, 4, 2, 2, generator=gen)
    unet, sched = Constant(0.0), DDPMScheduler(num_train_timesteps=1000, prediction_type="epsilon")
    losses = held_out_losses(unet, latents, None, noise, fixed_fractions(4), objective="diffusion", scheduler=sched)
    torch.testing.assert_close(losses, (noise**2).mean(dim=(1, 2, 3)).unsqueeze(1).expand(2, 4))
    assert [t.tolist() for t in unet.seen] == [[125] * 2, [375] * 2, [625] * 2, [875] * 2]
