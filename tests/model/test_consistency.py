"""Latent consistency distillation maths: the grid against diffusers' DDIM and LCM schedulers, the flow Euler
step, the boundary condition, the losses, per-sample draws, and which calls carry a gradient."""

import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler, LCMScheduler

from model.adapters import UNET_GROUPS, adapters_disabled, add_adapter, lora_config, target_pattern
from model.builders import build_unet, unet_config
from model.consistency import SolverGrid, draw_distill, lcm_loss, per_sample_loss, teacher_step
from tests.fixtures.training import TRAIN_UNET

BETAS = {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


def _diffusion_grid(prediction_type: str = "epsilon", points: int = 50) -> SolverGrid:
    ddpm = DDPMScheduler(**BETAS, prediction_type=prediction_type)
    return SolverGrid("diffusion", points, 1000, alphas_cumprod=ddpm.alphas_cumprod, prediction_type=prediction_type)


def _fixed_output(value: torch.Tensor):
    """A 'model' whose output ignores its inputs: the same for both guidance branches."""
    return lambda x, t, context: value.expand(x.shape[0], -1, -1, -1)


def test_the_diffusion_grid_is_lcms_and_its_scalings_are_lcm_schedulers():
    grid = _diffusion_grid()
    index = torch.tensor([0, 1, 24, 49])
    point = grid.point(index)
    assert point.model_t.tolist() == [19, 39, 499, 999]  # diffusers' DDIMSolver: (k+1)·T/N − 1
    assert grid.point(index - 1).model_t.tolist() == [0, 19, 479, 979]
    lcm = LCMScheduler(**BETAS, timestep_scaling=10.0)
    for t, c_skip, c_out in zip(point.model_t.tolist(), point.c_skip, point.c_out, strict=True):
        want_skip, want_out = lcm.get_scalings_for_boundary_condition_discrete(t)
        assert float(c_skip) == pytest.approx(want_skip, rel=1e-6)
        assert float(c_out) == pytest.approx(want_out, rel=1e-6)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_the_teachers_step_is_diffusers_ddim_step(prediction_type):
    """DDIM ("trailing" timesteps, η = 0, no clipping) from t to t − 20, the last one to ᾱ_0 — guidance moot when
    both branches agree."""
    grid = _diffusion_grid(prediction_type)
    ddim = DDIMScheduler(**BETAS, prediction_type=prediction_type, timestep_spacing="trailing", clip_sample=False,
                         set_alpha_to_one=False)  # fmt: skip
    ddim.set_timesteps(50)
    gen = torch.Generator().manual_seed(0)
    x, out = torch.randn(1, 4, 4, 4, generator=gen), torch.randn(1, 4, 4, 4, generator=gen)
    ctx = torch.zeros(1, 3, 8)
    for k in (49, 30, 0):
        t = int(grid.point(torch.tensor([k])).model_t)
        want = ddim.step(out, t, x).prev_sample
        got = teacher_step(_fixed_output(out), grid, x, ctx, ctx, torch.tensor([k]), torch.tensor([7.0]))
        assert torch.allclose(got, want, atol=1e-5), (k, (got - want).abs().max())


def test_the_flow_teachers_step_is_the_guided_euler_step():
    grid = SolverGrid("flow_matching", 10, 1000)
    gen = torch.Generator().manual_seed(1)
    x, v_c, v_u = (torch.randn(2, 4, 4, 4, generator=gen) for _ in range(3))

    def teacher(xx, t, context):  # cond rows get v_c, uncond rows v_u
        assert t.tolist() == pytest.approx([700.0, 100.0, 700.0, 100.0])
        return torch.where(context[:, :1, :1, None] > 0, torch.cat([v_c, v_c]), torch.cat([v_u, v_u]))

    cond, uncond = torch.ones(2, 3, 8), -torch.ones(2, 3, 8)
    w = torch.tensor([2.0, 5.0])
    got = teacher_step(teacher, grid, x, cond, uncond, torch.tensor([6, 0]), w)
    v = v_u + w.view(-1, 1, 1, 1) * (v_c - v_u)
    want = x + (torch.tensor([0.6, 0.0]) - torch.tensor([0.7, 0.1])).view(-1, 1, 1, 1) * v
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("objective", ["diffusion", "flow_matching"])
def test_the_consistency_function_is_the_identity_at_the_data_end(objective):
    grid = _diffusion_grid() if objective == "diffusion" else SolverGrid("flow_matching", 50, 1000)
    x, out = torch.randn(3, 4, 4, 4), torch.randn(3, 4, 4, 4)
    at_zero = grid.point(torch.tensor([-1, -1, -1]))
    assert torch.equal(grid.consistency(out, x, at_zero), x)
    high = grid.point(torch.tensor([49, 49, 49]))  # far from the boundary: (nearly) the predicted x0
    x0, _ = grid.data_and_noise(out, x, high)
    assert torch.allclose(grid.consistency(out, x, high), x0, atol=1e-3)


def test_pseudo_huber_and_l2_per_sample():
    pred, target = torch.zeros(2, 1, 1, 2), torch.tensor([[[[3.0, 4.0]]], [[[0.0, 0.0]]]])
    assert per_sample_loss(pred, target, "l2", 0.0).tolist() == [12.5, 0.0]
    c = 0.5
    want = ((9 + c * c) ** 0.5 - c + (16 + c * c) ** 0.5 - c) / 2
    assert per_sample_loss(pred, target, "huber", c).tolist() == pytest.approx([want, 0.0])


def test_a_samples_draws_do_not_depend_on_its_batch():
    latents = torch.randn(2, 4, 4, 4)
    both = draw_distill(latents, [torch.Generator().manual_seed(s) for s in (5, 6)], 50, (3.0, 15.0))
    alone = draw_distill(latents[1:], [torch.Generator().manual_seed(6)], 50, (3.0, 15.0))
    assert torch.equal(both.noise[1:], alone.noise) and torch.equal(both.index[1:], alone.index)
    assert torch.equal(both.guidance[1:], alone.guidance) and 3.0 <= float(both.guidance.min()) <= 15.0


def _adapted_unet() -> torch.nn.Module:
    unet = build_unet(unet_config(TRAIN_UNET), 0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in unet.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    add_adapter(unet, lora_config("lora", 2, None, 0.0, target_pattern(["cross_attention"], UNET_GROUPS)))
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5, generator=gen)
    return unet


def test_switching_the_adapter_off_gives_the_base_and_restores_its_gradients():
    unet = _adapted_unet()
    trainable = {n for n, p in unet.named_parameters() if p.requires_grad}
    x, t, ctx = torch.randn(1, 4, 8, 8), torch.tensor([500]), torch.randn(1, 77, TRAIN_UNET["cross_attention_dim"])
    with torch.no_grad():
        adapted = unet(x, t, encoder_hidden_states=ctx).sample
        with adapters_disabled(unet):
            base = unet(x, t, encoder_hidden_states=ctx).sample
        again = unet(x, t, encoder_hidden_states=ctx).sample
    plain = build_unet(unet_config(TRAIN_UNET), 0)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in plain.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        want = plain(x, t, encoder_hidden_states=ctx).sample
    assert torch.equal(base, want) and torch.equal(adapted, again) and not torch.equal(adapted, base)
    assert {n for n, p in unet.named_parameters() if p.requires_grad} == trainable


def test_only_the_student_call_carries_a_gradient_and_the_loss_is_per_sample():
    unet = _adapted_unet()
    grads = []

    def call(name):
        def run(x, t, context):
            grads.append((name, torch.is_grad_enabled()))
            if name == "teacher":
                with adapters_disabled(unet):
                    return unet(x, t, encoder_hidden_states=context).sample
            return unet(x, t, encoder_hidden_states=context).sample

        return run

    grid = SolverGrid("flow_matching", 8, 1000)
    latents, cond = torch.randn(2, 4, 8, 8), torch.randn(2, 77, TRAIN_UNET["cross_attention_dim"])
    uncond = torch.zeros(1, 77, TRAIN_UNET["cross_attention_dim"])
    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    losses = lcm_loss(call("student"), call("teacher"), call("target"), grid, latents, cond, uncond, gens,
                      w_range=(2.0, 4.0))  # fmt: skip
    assert grads == [("teacher", False), ("target", False), ("student", True)]
    losses.mean().backward()
    lora_grads = [p.grad for n, p in unet.named_parameters() if "lora_B" in n]
    assert all(g is not None and g.abs().sum() > 0 for g in lora_grads)
    alone = lcm_loss(call("student"), call("teacher"), call("target"), grid, latents[1:], cond[1:], uncond,
                     [torch.Generator().manual_seed(2)], w_range=(2.0, 4.0))  # fmt: skip
    # same draws, same loss up to the batch-size-dependent rounding of the convolutions (measured 2e-5 relative)
    assert float(alone[0].detach()) == pytest.approx(float(losses[1].detach()), rel=1e-3)
