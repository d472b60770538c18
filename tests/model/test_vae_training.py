"""Training the tiny VAE: it learns, it is reproducible, NaN raises, and the latent scale is 1/std."""

from __future__ import annotations

import itertools

import pytest
import torch

from model.builders import build_tiny_vae, seeded
from model.vae_training import latent_scaling_factor, reconstruct, train_vae

PALETTE = torch.tensor(
    [[220, 30, 30], [30, 170, 40], [30, 60, 220], [240, 220, 30], [245, 245, 245], [15, 15, 15]],
    dtype=torch.float32,
) / 127.5 - 1


def two_tone_batches(seed: int, batch: int = 16, size: int = 16):
    """Endless batches: a palette background with a palette square in a random spot, in [-1, 1]."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield two_tone(g, batch, size)[0]


def two_tone(g: torch.Generator, n: int, size: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    """``n`` images, the foreground palette index of each, and each square's centre pixel."""
    bg = torch.randint(0, len(PALETTE), (n,), generator=g)
    fg = (bg + torch.randint(1, len(PALETTE), (n,), generator=g)) % len(PALETTE)
    images = PALETTE[bg][:, :, None, None].expand(n, 3, size, size).clone()
    centres = []
    for i in range(n):
        y, x = torch.randint(0, size // 2, (2,), generator=g).tolist()
        images[i, :, y : y + size // 2, x : x + size // 2] = PALETTE[fg[i]][:, None, None]
        centres.append((y + size // 4, x + size // 4))
    return images, fg, centres


def _train(seed: int, steps: int) -> tuple[torch.nn.Module, list[float]]:
    vae = build_tiny_vae([16, 32], layers_per_block=1, latent_channels=4, seed=seed)
    with seeded(seed):
        losses = train_vae(vae, two_tone_batches(seed), steps=steps, lr=4e-3, kl_weight=1e-6)
    return vae, losses


def test_short_training_reconstructs_colours():
    vae, losses = _train(seed=0, steps=150)
    assert len(losses) == 150
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:10]) / 10
    images, fg, centres = two_tone(torch.Generator().manual_seed(99), 32, 16)
    recon = reconstruct(vae, images)
    assert recon.shape == images.shape and recon.min() >= -1 and recon.max() <= 1
    mae_255 = float((recon - images).abs().mean() * 127.5)
    assert mae_255 < 35.0
    # the centre of each square decodes to its own palette colour (nearest colour)
    centre_rgb = torch.stack([recon[i, :, y, x] for i, (y, x) in enumerate(centres)])
    nearest = torch.cdist(centre_rgb, PALETTE).argmin(1)
    assert (nearest == fg).float().mean() >= 0.9


def test_training_is_deterministic_for_a_seed():
    a, la = _train(seed=1, steps=3)
    b, lb = _train(seed=1, steps=3)
    assert la == lb
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_zero_steps_is_a_no_op():
    vae = build_tiny_vae([8, 16], 1, 4, seed=0)
    before = {k: v.clone() for k, v in vae.state_dict().items()}
    assert train_vae(vae, two_tone_batches(0), steps=0, lr=1e-3, kl_weight=0.0) == []
    assert all(torch.equal(before[k], v) for k, v in vae.state_dict().items())


def test_nan_loss_raises_with_the_step():
    vae = build_tiny_vae([8, 16], 1, 4, seed=0)
    batches = itertools.chain([torch.zeros(2, 3, 8, 8)], itertools.repeat(torch.full((2, 3, 8, 8), float("nan"))))
    with pytest.raises(FloatingPointError, match="at step 1"):
        train_vae(vae, batches, steps=5, lr=1e-3, kl_weight=1e-6)


def test_latent_scaling_factor_is_inverse_std_of_posterior_means():
    vae = build_tiny_vae([8, 16], 1, 4, seed=0)
    images = torch.rand(8, 3, 16, 16) * 2 - 1
    factor = latent_scaling_factor(vae, images)
    with torch.no_grad():
        means = vae.encode(images).latent_dist.mean
    assert factor == pytest.approx(1 / float(means.double().std()), rel=1e-6)
    assert float((means * factor).double().std()) == pytest.approx(1.0, rel=1e-6)
    # batches give the same answer as one tensor
    assert latent_scaling_factor(vae, images.split(3)) == pytest.approx(factor, rel=1e-6)
