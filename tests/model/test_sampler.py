"""DDIM sampler: training betas, no x0 clamp, zero-SNR trailing steps, CFG with a negative prompt."""

import pytest
import torch

from model.builders import noise_scheduler
from model.sampler import ddim_from_training, sample_latents, sampling_scheduler
from tests.fixtures.eval_workspace import DEMO_NOISE
from tests.fixtures.eval_workspace import tiny_unet as tiny_unet_seeded

SD_NOISE = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    prediction_type="epsilon",
)


@pytest.mark.parametrize("noise", [SD_NOISE, DEMO_NOISE], ids=["sd-eps", "zero-snr-v"])
def test_ddim_uses_training_betas_and_never_clamps(noise):
    ddim = ddim_from_training(dict(noise_scheduler(noise).config))
    assert ddim.config.clip_sample is False and ddim.config.set_alpha_to_one is False
    assert ddim.config.beta_schedule == "scaled_linear" and ddim.config.beta_end == 0.012
    assert ddim.config.prediction_type == noise["prediction_type"]
    ddim.set_timesteps(10)
    t = ddim.timesteps[-2]
    x0 = torch.full((1, 4, 2, 2), 4.0)  # SD latents have |x0| ≈ 4: a clamp to [-1, 1] would destroy them
    alpha = ddim.alphas_cumprod[t]
    eps = torch.zeros_like(x0)
    x_t = alpha.sqrt() * x0 + (1 - alpha).sqrt() * eps
    model_out = eps if noise["prediction_type"] == "epsilon" else alpha.sqrt() * eps - (1 - alpha).sqrt() * x0
    out = ddim.step(model_out, t, x_t)
    torch.testing.assert_close(out.pred_original_sample, x0, rtol=1e-4, atol=1e-4)
    # η = 0, ε = 0: the next latent is √ᾱ_prev · x0, with x0 = 4 intact (a clamp would give ≤ √ᾱ_prev)
    torch.testing.assert_close(out.prev_sample, ddim.alphas_cumprod[ddim.timesteps[-1]].sqrt() * x0)
    assert out.prev_sample.min().item() > 3.5


def test_zero_snr_schedule_samples_from_t_max():
    noise = {**SD_NOISE, "prediction_type": "v_prediction", "rescale_betas_zero_snr": True}
    train = noise_scheduler(noise)
    assert train.alphas_cumprod[-1].item() == pytest.approx(0.0, abs=1e-8)
    ddim = ddim_from_training(dict(train.config))
    ddim.set_timesteps(25)
    assert ddim.timesteps[0].item() == 999  # trailing: starts where training saw pure noise
    sd = ddim_from_training(dict(noise_scheduler(SD_NOISE).config))
    sd.set_timesteps(25)
    assert sd.timesteps[0].item() == 961  # SD's leading spacing + steps_offset 1


@pytest.fixture(scope="module")
def tiny_unet():
    return tiny_unet_seeded(0)


def _sample(unet, cond, uncond, seed=0, guidance=5.0):
    ddim = ddim_from_training(SD_NOISE)
    return sample_latents(
        unet,
        ddim,
        cond,
        uncond,
        steps=4,
        guidance_scale=guidance,
        latent_shape=(4, 8, 8),
        generators=[torch.Generator().manual_seed(seed)],
    )


def test_negative_prompt_changes_the_image(tiny_unet):
    cond = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(1))
    empty = torch.zeros(1, 5, 16)
    negative = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(2))
    a, b = _sample(tiny_unet, cond, empty), _sample(tiny_unet, cond, negative)
    assert (a - b).abs().max().item() > 1e-3
    assert torch.equal(a, _sample(tiny_unet, cond, empty))  # deterministic for a seed


def test_image_depends_only_on_its_own_seed(tiny_unet):
    cond = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    uncond = torch.zeros(1, 5, 16)
    ddim = ddim_from_training(SD_NOISE)
    pair = sample_latents(
        tiny_unet,
        ddim,
        cond,
        uncond,
        steps=4,
        guidance_scale=3.0,
        latent_shape=(4, 8, 8),
        generators=[torch.Generator().manual_seed(s) for s in (5, 6)],
    )
    alone = _sample(tiny_unet, cond[1:], uncond, seed=6, guidance=3.0)
    torch.testing.assert_close(pair[1:], alone, rtol=1e-4, atol=1e-5)


def test_one_generator_per_prompt_is_enforced(tiny_unet):
    with pytest.raises(ValueError, match="one generator per prompt"):
        sample_latents(
            tiny_unet,
            ddim_from_training(SD_NOISE),
            torch.zeros(2, 5, 16),
            torch.zeros(1, 5, 16),
            steps=2,
            guidance_scale=1.0,
            latent_shape=(4, 8, 8),
            generators=[torch.Generator()],
        )


DISTILL = {"num_ddim_timesteps": 50, "timestep_scaling": 10.0, "sampling_steps": 4}


def test_sampling_scheduler_is_lcm_for_a_distilled_diffusion_phase_and_flow_euler_for_a_distilled_flow_one():
    lcm = sampling_scheduler(dict(noise_scheduler(DEMO_NOISE).config), "diffusion", distill=DISTILL)
    assert type(lcm).__name__ == "LCMScheduler"
    cfg = lcm.config
    assert (cfg.original_inference_steps, cfg.timestep_scaling, cfg.clip_sample) == (50, 10.0, False)
    assert (cfg.prediction_type, cfg.rescale_betas_zero_snr) == ("v_prediction", True)
    assert cfg.steps_offset == 1  # what StableDiffusionPipeline would rewrite it to
    lcm.set_timesteps(4)
    assert lcm.timesteps.tolist() == [999, 759, 499, 259]  # 4 of the distillation grid's 20·k − 1
    flow = sampling_scheduler(DEMO_NOISE, "flow_matching", 2.0, distill=DISTILL)
    assert type(flow).__name__ == "DPMSolverMultistepScheduler" and flow.config.flow_shift == 2.0
    assert type(sampling_scheduler(DEMO_NOISE, "diffusion")).__name__ == "DDIMScheduler"


def _count_calls(unet) -> list[int]:
    """The batch size of each of ``unet``'s forward calls from now on (a forward hook)."""
    batches: list[int] = []
    unet.register_forward_hook(lambda module, args, out: batches.append(args[0].shape[0]))
    return batches


def test_guidance_1_is_one_unet_call_per_step_on_the_prompt_alone():
    unet = tiny_unet_seeded(0)
    batches = _count_calls(unet)
    cond = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    seeds = (5, 6)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    got = sample_latents(unet, ddim_from_training(SD_NOISE), cond, None, steps=4, guidance_scale=1.0,
                         latent_shape=(4, 8, 8), generators=gens)  # fmt: skip
    assert batches == [2] * 4  # 4 steps, one call each on the 2 prompts (no unconditional half)
    scheduler = ddim_from_training(SD_NOISE)  # by hand: the cond-only sampler
    latents = torch.stack([torch.randn((4, 8, 8), generator=torch.Generator().manual_seed(s)) for s in seeds])
    scheduler.set_timesteps(4)
    with torch.no_grad():
        for t in scheduler.timesteps:
            latents = scheduler.step(unet(latents, t, encoder_hidden_states=cond).sample, t, latents).prev_sample
    assert torch.equal(got, latents)
    batches.clear()
    sample_latents(unet, ddim_from_training(SD_NOISE), cond, torch.zeros(1, 5, 16), steps=4, guidance_scale=3.0,
                   latent_shape=(4, 8, 8), generators=[torch.Generator().manual_seed(s) for s in seeds])  # fmt: skip
    assert batches == [4] * 4  # with CFG: the unconditional and the conditional half in one call per step


def test_lcm_noise_between_steps_comes_from_each_images_own_generator(tiny_unet):
    """LCM re-noises between steps: each row from its image's generator, so an image in a batch of two equals it
    sampled alone (a shared generator would not)."""
    cond = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))

    def lcm(c, seeds):
        return sample_latents(tiny_unet, sampling_scheduler(SD_NOISE, distill=DISTILL), c, None, steps=4,
                              guidance_scale=1.0, latent_shape=(4, 8, 8),
                              generators=[torch.Generator().manual_seed(s) for s in seeds])  # fmt: skip

    pair, alone = lcm(cond, (5, 6)), lcm(cond[1:], (6,))
    torch.testing.assert_close(pair[1:], alone, rtol=1e-4, atol=1e-5)
    ddim = _sample(tiny_unet, cond[1:], torch.zeros(1, 5, 16), seed=6, guidance=1.0)
    assert (alone - ddim).abs().max().item() > 1e-2  # another sampler
