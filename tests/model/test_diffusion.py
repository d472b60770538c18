"""Training maths: targets, Min-SNR weights (hand-computed), CFG dropout, LR schedule closed form."""

import math

import pytest
import torch
from diffusers import DDPMScheduler

from model.diffusion import (
    build_lr_scheduler,
    cfg_dropout,
    diffusion_loss,
    lr_at,
    min_snr_weights,
    optimizer_steps,
    training_target,
)


def _sched(prediction_type):
    return DDPMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type=prediction_type,
    )


def _alpha_bar(t):
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    return torch.cumprod(1 - betas, 0)[t]


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights_match_hand_computation(prediction_type):
    t = torch.tensor([0, 10, 250, 999])
    gamma = 5.0
    ab = _alpha_bar(t)
    snr = ab / (1 - ab)
    expected = torch.minimum(snr, torch.full_like(snr, gamma))
    expected = expected / snr if prediction_type == "epsilon" else expected / (snr + 1)
    got = min_snr_weights(_sched(prediction_type), t, gamma)
    torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-6)
    # low-noise timesteps (huge SNR) are down-weighted, high-noise ones keep weight 1 (eps)
    assert got[0] < 0.01
    if prediction_type == "epsilon":
        assert got[-1] == pytest.approx(1.0)


def test_min_snr_off_returns_none():
    assert min_snr_weights(_sched("epsilon"), torch.tensor([1]), None) is None


def test_targets_epsilon_and_v():
    x0 = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    eps = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    t = torch.tensor([100, 900])
    assert torch.equal(training_target(_sched("epsilon"), x0, eps, t), eps)
    ab = _alpha_bar(t).float().view(-1, 1, 1, 1)
    v = ab.sqrt() * eps - (1 - ab).sqrt() * x0
    torch.testing.assert_close(training_target(_sched("v_prediction"), x0, eps, t), v, rtol=1e-4, atol=1e-5)


def test_bad_prediction_type_is_clear():
    s = _sched("epsilon")
    s.register_to_config(prediction_type="sample")
    with pytest.raises(ValueError, match="prediction type must be one of epsilon, v_prediction; got 'sample'"):
        training_target(s, torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor([1]))


def test_weighted_loss_is_per_sample_weighted_mean():
    pred = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    target = torch.zeros(2, 2)
    assert diffusion_loss(pred, target, None).item() == pytest.approx((1 + 4) / 2)
    assert diffusion_loss(pred, target, torch.tensor([1.0, 0.5])).item() == pytest.approx((1 + 2) / 2)


def test_cfg_dropout_rate_and_replacement():
    cond = torch.ones(1000, 3, 2)
    uncond = torch.zeros(1, 3, 2)
    out = cfg_dropout(cond, uncond, 0.15, torch.Generator().manual_seed(0))
    dropped = (out.sum(dim=(1, 2)) == 0).float().mean().item()
    assert 0.12 < dropped < 0.18
    assert set(out.sum(dim=(1, 2)).tolist()) <= {0.0, 6.0}
    assert torch.equal(cfg_dropout(cond, uncond, 0.0, torch.Generator()), cond)


def test_optimizer_steps_counts_accumulation_and_partial_batch():
    # 100 samples, batch 24 → 5 batches (last partial); accum 2 → 3 optimizer steps per epoch
    assert optimizer_steps(100, 24, 2, 4) == 12


def test_lr_schedule_matches_closed_form_every_step():
    peak, warmup = 1e-3, 3
    total = optimizer_steps(100, 24, 2, 4)  # accumulation 2 and a partial last batch
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=peak)
    sched = build_lr_scheduler(opt, peak, warmup, total)
    seen = []
    for _step in range(total):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    expected = [lr_at(s, peak, warmup, total) for s in range(total)]
    assert seen == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert seen[0] == pytest.approx(peak * 1e-2)
    assert max(seen) == pytest.approx(peak)
    assert lr_at(total, peak, warmup, total) == pytest.approx(peak * 1e-2)
    assert math.isclose(seen[warmup], peak)


def test_lr_schedule_rebuilt_after_warmup_keeps_its_peak_and_floor():
    """A schedule rebuilt while warm-up has the optimizer at peak × 1e-2 (a run resumed on another world size
    before its first checkpoint) is the same schedule: it ends at peak × 1e-2, not peak × 1e-4."""
    peak, warmup, total = 1e-3, 2, 6
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=peak)
    build_lr_scheduler(opt, peak, warmup, total)
    assert opt.param_groups[0]["lr"] == pytest.approx(peak * 1e-2)  # warm-up's first LR
    sched = build_lr_scheduler(opt, peak, warmup, total)
    seen = []
    for _step in range(total + 2):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:total] == pytest.approx([lr_at(s, peak, warmup, total) for s in range(total)], rel=1e-9)
    assert min(seen) == pytest.approx(peak * 1e-2)


def test_noise_offset_shifts_each_channel_mean():
    from model.diffusion import denoising_loss

    seen = {}

    class Spy(torch.nn.Module):
        denoiser_family = "unet"  # called like a UNet (model.denoisers.family_of)

        def forward(self, x, t, encoder_hidden_states):
            seen["x"] = x
            return type("Out", (), {"sample": torch.zeros_like(x)})()

    sched = _sched("epsilon")
    latents = torch.zeros(64, 4, 8, 8)
    for offset in (0.0, 1.0):
        denoising_loss(Spy(), sched, latents, torch.zeros(64, 1, 1), torch.Generator().manual_seed(0), None, offset)
        seen[offset] = seen["x"].mean(dim=(2, 3)).std().item()
    # without offset the per-channel means of pure noise are ~N(0, 1/64); with offset 1 they are ~N(0, 1)
    assert seen[0.0] < 0.3 and seen[1.0] > 0.5


def test_zero_snr_requires_v_prediction():
    from sdforge.config import NoiseSchedule

    with pytest.raises(ValueError, match="needs prediction_type v_prediction"):
        NoiseSchedule(rescale_betas_zero_snr=True)
    assert NoiseSchedule(rescale_betas_zero_snr=True, prediction_type="v_prediction").rescale_betas_zero_snr


# -- EMA ---------------------------------------------------------------------------------------


def test_ema_decay_sequence_is_min_peak_one_plus_step_over_ten_plus_step():
    from model.diffusion import ema_decay

    assert [ema_decay(k, 0.9999) for k in range(1, 6)] == [2 / 11, 3 / 12, 4 / 13, 5 / 14, 6 / 15]
    first_at_peak = next(k for k in range(1, 200_000) if ema_decay(k, 0.9999) == 0.9999)
    assert first_at_peak == 89_990
    assert ema_decay(10**7, 0.9999) == 0.9999


def test_training_ema_decay_equals_diffusers_ema_model():
    from diffusers.training_utils import EMAModel

    from model.diffusion import TrainingEMA, ema_decay

    p = [torch.nn.Parameter(torch.zeros(2))]
    ours, shifted, default = TrainingEMA(p, 0.9999), EMAModel(p, decay=0.9999, update_after_step=-1), EMAModel(p)
    for k in [*range(1, 50), 1000, 89_990, 89_991, 89_992, 10**6]:
        assert ours.get_decay(k) == shifted.get_decay(k) == ema_decay(k, 0.9999)
        assert default.get_decay(k + 1) == ema_decay(k, 0.9999)  # diffusers' default counts from 0
    assert default.get_decay(1) == 0.0  # ... and copies the weights at its first update


def test_training_ema_updates_bit_exactly():
    from model.diffusion import TrainingEMA, ema_decay

    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, generator=gen))
    ema, shadow = TrainingEMA([p], 0.9), p.detach().clone()
    for k in range(1, 40):
        with torch.no_grad():
            p.add_(torch.randn(5, generator=gen))
        ema.step([p])
        shadow.sub_((1 - ema_decay(k, 0.9)) * (shadow - p.detach()))
        assert torch.equal(ema.shadow_params[0], shadow)
    assert ema.optimization_step == 39


def test_training_ema_every_n_steps_multiplies_the_decays():
    from model.diffusion import TrainingEMA, ema_decay

    ema = TrainingEMA([torch.nn.Parameter(torch.zeros(1))], 0.9999, every=4)
    assert ema.get_decay(1) == math.prod(ema_decay(k, 0.9999) for k in (1, 2, 3, 4))
    assert ema.get_decay(2) == math.prod(ema_decay(k, 0.9999) for k in (5, 6, 7, 8))
    assert ema.get_decay(10**6) == pytest.approx(0.9999**4, rel=1e-15)
    # a constant target: one 4-step update lands where four 1-step updates would
    one, four = (TrainingEMA([torch.nn.Parameter(torch.zeros(1))], 0.9, every=n) for n in (1, 4))
    target = [torch.nn.Parameter(torch.ones(1))]
    for _ in range(4):
        one.step(target)
    four.step(target)
    assert four.shadow_params[0].item() == pytest.approx(one.shadow_params[0].item(), rel=1e-12)
    with pytest.raises(ValueError, match="≥ 1; got 0"):
        TrainingEMA(target, 0.9, every=0)


def test_unet_attention_uses_sdpa():
    from diffusers.models.attention_processor import AttnProcessor2_0

    from model.builders import build_unet, unet_config
    from tests.fixtures.training import TINY_UNET

    spec = {"in_channels": 4, "out_channels": 4, **TINY_UNET}
    processors = build_unet(unet_config(spec), seed=0).attn_processors
    assert processors and all(type(p) is AttnProcessor2_0 for p in processors.values())


def test_logit_normal_timesteps_follow_the_sigmoid_of_a_normal():
    from model.diffusion import sample_timesteps

    uniform = sample_timesteps(20000, 1000, torch.Generator().manual_seed(0)).float()
    for mean, share_above_half in ((0.0, 0.5), (0.5, 0.6915), (-1.0, 0.1587)):
        t = sample_timesteps(20000, 1000, torch.Generator().manual_seed(0), (mean, 1.0))
        assert t.dtype == torch.long and int(t.min()) >= 0 and int(t.max()) <= 999
        # P(t >= 500) = P(mean + z > 0) = Phi(mean)
        assert abs(float((t >= 500).float().mean()) - share_above_half) < 0.01, mean
    assert abs(float((uniform >= 500).float().mean()) - 0.5) < 0.01
    gens = [torch.Generator().manual_seed(i) for i in range(4)]  # per-sample streams, as the trainer draws
    assert sample_timesteps(4, 1000, gens, (0.5, 1.0)).shape == (4,)
