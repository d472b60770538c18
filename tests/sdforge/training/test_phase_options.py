"""Each training option of a phase (``phases.<p>.…``) changes exactly what it should, through the trainer's loss."""

from __future__ import annotations

import os

import pytest
import torch
from diffusers import DDPMScheduler

from sdforge.config import ConfigError, Phase, parse_params
from sdforge.io import InputError
from sdforge.training import optimizers
from sdforge.training.optimizers import build_optimizer
from sdforge.training.step import phase_loss
from tests.fixtures.training import tiny_params

BASE = {"mix": {"laion": 1.0}, "samples": 8, "lr": 1e-3, "min_snr_gamma": None}
SCHED = DDPMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", prediction_type="v_prediction")


class Spy(torch.nn.Module):
    """Records the UNet's input and timesteps; predicts zeros."""

    denoiser_family = "unet"  # called like a UNet (model.denoisers.family_of)

    def forward(self, x, t, encoder_hidden_states):
        self.x, self.t = x, t
        return type("Out", (), {"sample": torch.zeros_like(x)})()


def run_loss(objective: str = "diffusion", batch: int = 4096, latents: torch.Tensor | None = None, **options):
    """The spy after one ``phase_loss`` call on zero latents (``[batch, 4, 2, 2]``) with ``options``."""
    spy = Spy()
    x0 = torch.zeros(batch, 4, 2, 2) if latents is None else latents
    phase_loss(Phase(**BASE, **options), objective, spy, SCHED, x0, torch.zeros(1), torch.Generator().manual_seed(0))
    return spy


@pytest.mark.parametrize("objective", ["diffusion", "flow_matching"])
def test_noise_offset_shifts_each_channels_mean_and_nothing_else(objective):
    plain, offset = run_loss(objective), run_loss(objective, noise_offset=0.5)
    channel_means = {k: s.x.mean(dim=(2, 3)) for k, s in (("plain", plain), ("offset", offset))}
    # per-channel means of 2×2 noise: std 1/2 without the offset, √(1/4 + 1/4) with an offset of 0.5
    assert float(channel_means["plain"].std()) == pytest.approx(0.5 * _input_scale(plain, objective), rel=0.05)
    assert float(channel_means["offset"].std()) == pytest.approx(0.5**0.5 * _input_scale(offset, objective), rel=0.05)


def _input_scale(spy: Spy, objective: str) -> float:
    """The mean factor in front of the noise in the UNet input at the drawn timesteps (zero latents)."""
    if objective == "flow_matching":
        return float((spy.t / 1000).pow(2).mean().sqrt())
    return float((1 - SCHED.alphas_cumprod[spy.t]).mean().sqrt())


@pytest.mark.parametrize("objective", ["diffusion", "flow_matching"])
def test_logit_normal_moves_the_timestep_histogram_by_its_mean(objective):
    uniform = run_loss(objective).t.float()
    shifted = run_loss(objective, timestep_sampling="logit_normal", logit_normal=(1.0, 1.0)).t.float()
    assert abs(float((uniform >= 500).float().mean()) - 0.5) < 0.02
    assert abs(float((shifted >= 500).float().mean()) - 0.8413) < 0.02  # Φ(1)
    # the [mean, std] is read only when the sampling asks for it
    ignored = run_loss(objective, timestep_sampling="uniform", logit_normal=(1.0, 1.0)).t
    assert torch.equal(ignored, run_loss(objective).t)


def test_flow_shift_moves_sigma_up_only_for_flow_matching():
    plain, shifted = run_loss("flow_matching"), run_loss("flow_matching", flow_shift=3.0)
    s = plain.t / 1000
    assert torch.allclose(shifted.t / 1000, 3 * s / (1 + 2 * s), atol=1e-6)
    assert torch.equal(run_loss("diffusion", flow_shift=3.0).t, run_loss("diffusion").t)


@pytest.mark.parametrize("objective", ["diffusion", "flow_matching"])
def test_input_perturbation_adds_to_the_input_only(objective):
    latents = torch.randn(256, 4, 2, 2, generator=torch.Generator().manual_seed(5))
    plain = run_loss(objective, latents=latents)
    perturbed = run_loss(objective, latents=latents, input_perturbation=0.1)
    assert torch.equal(plain.t, perturbed.t)
    assert not torch.equal(plain.x, perturbed.x)
    # zero predictions: the loss is the target's mean square, the same with and without the perturbation
    gen = torch.Generator
    args = (Spy(), SCHED, latents, torch.zeros(1))
    a = phase_loss(Phase(**BASE), objective, *args, gen().manual_seed(0))
    b = phase_loss(Phase(**BASE, input_perturbation=0.1), objective, *args, gen().manual_seed(0))
    assert torch.equal(a, b)


def test_flow_matching_with_min_snr_is_refused_naming_the_key(tmp_path):
    data = tiny_params(tmp_path)
    data["train"]["objective"] = "flow_matching"
    data["phases"]["phase1"]["min_snr_gamma"] = None
    data["phases"]["phase2"]["min_snr_gamma"] = 5.0
    with pytest.raises(ConfigError, match=r"phases.phase2.min_snr_gamma: Min-SNR-γ weights the diffusion"):
        parse_params(data)
    data["phases"]["phase2"]["min_snr_gamma"] = None
    data["phases"]["phase2"]["objective"] = "diffusion"  # the phase's own objective wins over train.objective
    params = parse_params(data)
    assert params.phase_objective("phase1") == "flow_matching" and params.phase_objective("phase2") == "diffusion"


def test_a_flow_matching_phase_that_leaves_min_snr_unset_gets_null_and_diffusion_keeps_the_default(tmp_path):
    data = tiny_params(tmp_path)
    data["train"]["objective"] = "flow_matching"
    for phase in data["phases"].values():
        phase.pop("min_snr_gamma", None)
    data["phases"]["phase2"]["objective"] = "diffusion"
    params = parse_params(data)
    assert params.phases["phase1"].min_snr_gamma is None  # the 5.0 default is the diffusion objective's
    assert params.phases["phase2"].min_snr_gamma == 5.0


def _step(opt, param: torch.nn.Parameter, grad: float = 1.0) -> None:
    param.grad = torch.full_like(param, grad)
    opt.step()


def test_prodigy_adapts_its_step_size_and_adamw_does_not(tmp_path):
    train = parse_params(tiny_params(tmp_path)).train
    moved = {}
    for name in ("adamw", "prodigy"):
        param = torch.nn.Parameter(torch.zeros(64))
        opt = build_optimizer(name, [param], 1.0 if name == "prodigy" else 1e-3, train, torch.device("cpu"), "x")
        for _ in range(20):
            _step(opt, param)
        moved[name] = (type(opt).__name__, float(param.detach().abs().mean()), opt.param_groups[0].get("d"))
    assert moved["adamw"][0] == "AdamW" and moved["adamw"][1] == pytest.approx(20e-3, rel=0.05)
    name, distance, d = moved["prodigy"]
    assert name == "Prodigy" and d > 1e-6  # D-adaptation grew its step size from d0 = 1e-6
    assert distance > 0


def test_adamw8bit_without_bitsandbytes_names_the_key_and_the_install(tmp_path, monkeypatch):
    train = parse_params(tiny_params(tmp_path)).train
    real = optimizers.importlib.import_module

    def missing(name, *args):
        if name == "bitsandbytes":
            raise ModuleNotFoundError("No module named 'bitsandbytes'")
        return real(name, *args)

    monkeypatch.setattr(optimizers.importlib, "import_module", missing)
    with pytest.raises(InputError, match=r"phases.phase9.optimizer: needs the package 'bitsandbytes'.*pip install"):
        build_optimizer(
            "adamw8bit",
            [torch.nn.Parameter(torch.zeros(4))],
            1e-3,
            train,
            torch.device("cpu"),
            "phases.phase9.optimizer",
        )


def test_adamw8bit_keeps_8_bit_states(tmp_path):
    if os.environ.get("SDFORGE_REQUIRE_BITSANDBYTES") == "1":
        import bitsandbytes  # noqa: F401  (CI: fail, not skip, when the optional package is missing)
    pytest.importorskip("bitsandbytes", reason="adamw8bit's package is optional: pip install bitsandbytes")
    train = parse_params(tiny_params(tmp_path)).train
    param = torch.nn.Parameter(torch.zeros(4096))
    opt = build_optimizer("adamw8bit", [param], 1e-3, train, torch.device("cpu"), "x")
    _step(opt, param)
    assert type(opt).__name__ == "AdamW8bit"
    assert opt.state[param]["state1"].dtype == torch.uint8 and float(param.detach().abs().mean()) > 0
