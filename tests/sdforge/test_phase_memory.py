"""The adapter memory forecast (``sdforge preflight --memory``): the fake-tensor profile is the real one, the peak
is the memory plan's formula plus what the setup holds, NF4 takes out exactly its linears' bytes, and the CLI
prints a row per adapter phase of configs/full/sdxl.yaml (with a tiny UNet layout, so it runs in seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from torch._subclasses.fake_tensor import FakeTensorMode

from model.activation_memory import OUTSIDE, ActivationProfile, as_fake_tensors
from model.adapters import add_adapter, lora_config, target_pattern
from model.denoisers import family
from model.quantization import NF4_BYTES_PER_WEIGHT
from sdforge.config import parse_params
from sdforge.preflight.phase_memory import SetupMemory, measure_setup, memory_rows
from sdforge.training.memory_plan import FACTOR_CHECKPOINTED, FACTOR_KEPT, GIB, USABLE_SHARE
from sdforge.training.model_setup import activation_profile
from tools.preflight import main as preflight_main
from tools.tiny_demo import merged

REPO = Path(__file__).resolve().parents[2]
TINY_SDXL = yaml.safe_load((REPO / "configs/demo-sdxl/overlay.yaml").read_text())["models"]["sdxl"]


def _sdxl_unet(device: str):
    sdxl = family("sdxl")
    with torch.device(device):
        unet = sdxl.build(sdxl.config({**TINY_SDXL, "sample_size": 8}), seed=0)
        add_adapter(unet, lora_config("lora", 4, None, 0.0, target_pattern(["self_attention"], sdxl.lora_groups)))
    return sdxl, unet.train()


def test_the_fake_profile_is_the_real_one():
    """A tiny SDXL UNet with a LoRA: the fixed parts and FLOPs are equal; what a sample keeps agrees within 0.5 %
    (a few small tensors whose storages differ in size), checkpointed or not (measured: 384 B of 353 KB under
    checkpointing; ~53 KB apart while freed storages' addresses could be counted as already seen)."""
    sdxl, real = _sdxl_unet("cpu")
    _, fake = _sdxl_unet("meta")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    as_fake_tensors(fake, mode, torch.device("cpu"))
    measured = activation_profile(real, sdxl, torch.device("cpu"), True, (16, 16))
    with mode:
        forecast = activation_profile(fake, sdxl, torch.device("cpu"), True, (16, 16))
    for field in ("kept_fixed", "checkpointed_fixed", "forward_flops"):
        assert getattr(measured, field) == getattr(forecast, field), field
    kept, fake_kept = sum(measured.kept_per_sample.values()), sum(forecast.kept_per_sample.values())
    assert kept > 0 and abs(kept - fake_kept) <= 5e-3 * kept
    checkpointed, fake_checkpointed = (sum(p.checkpointed_per_sample.values()) for p in (measured, forecast))
    assert checkpointed > 0 and abs(checkpointed - fake_checkpointed) <= 5e-3 * checkpointed


@pytest.mark.slow  # ~1 min: the full-size SD1.5 UNet's forward on fake tensors
def test_the_fake_profile_of_the_full_sd15_unet_is_the_stored_real_one():
    from tests.fixtures.sd15_profile import stored

    sd15 = family("unet")
    params = parse_params(yaml.safe_load((REPO / "configs/full/params.yaml").read_text()))
    with torch.device("meta"):
        unet = sd15.build(sd15.config(params.models.denoiser_spec), seed=0).train()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    as_fake_tensors(unet, mode, torch.device("cpu"))
    with mode:
        forecast = activation_profile(unet, sd15, torch.device("cpu"), True, (64, 64))
    real = stored()
    for field in ("kept_per_sample", "kept_fixed", "checkpointed_per_sample", "checkpointed_fixed", "forward_flops"):
        a, b = sum(getattr(real, field).values()), sum(getattr(forecast, field).values())
        assert abs(a - b) <= 1e-3 * a, field  # measured: 0.02 % at most


def _setup(**held) -> SetupMemory:
    profile = ActivationProfile(
        kept_per_sample={"a": 1.0 * GIB, OUTSIDE: 0.0}, kept_fixed={"a": 0.5 * GIB, OUTSIDE: 0.0},
        checkpointed_per_sample={"a": 0.25 * GIB, OUTSIDE: 0.0}, checkpointed_fixed={"a": 0.0, OUTSIDE: 0.0},
        forward_flops={"a": 1.0, OUTSIDE: 0.0},
    )  # fmt: skip
    values = {"frozen_bytes": 4 * GIB, "trained_bytes": 0.5 * GIB, "text_bytes": 1 * GIB, "text_per_sample": 0.0,
              "text_fixed": 0.0, **held}  # fmt: skip
    return SetupMemory("p", "lora", 10, profile=profile, latent_hw=(128, 128), **values)


def test_the_peak_is_what_the_setup_holds_plus_the_plans_activations():
    setup = _setup(text_per_sample=0.1 * GIB, text_fixed=0.2 * GIB)
    held = 4 + 0.5 + 1 + 0.2
    assert setup.peak(3, False) / GIB == pytest.approx(held + 0.5 + 3 * FACTOR_KEPT + 3 * 0.1 * FACTOR_KEPT)
    assert setup.peak(3, True) / GIB == pytest.approx(held + 3 * 0.25 * FACTOR_CHECKPOINTED + 3 * 0.1 * FACTOR_KEPT)
    budget = 16.0
    off = setup.largest_batch(budget, False)
    assert setup.peak(off, False) <= USABLE_SHARE * budget * GIB < setup.peak(off + 1, False)
    row = memory_rows([setup], [budget])[0]
    assert row["batch_at_16gib"] == off and row["batch_at_16gib_checkpointed"] == setup.largest_batch(budget, True)
    assert _setup(frozen_bytes=20 * GIB).largest_batch(budget, True) == 0  # nothing fits: 0, not a negative


def _sdxl_params(tmp_path: Path) -> object:
    """configs/full/params.yaml + configs/full/sdxl.yaml with the demo's tiny SDXL layout (the architecture that
    makes a forecast take minutes is not what these tests check)."""
    data = merged(yaml.safe_load((REPO / "configs/full/params.yaml").read_text()),
                  yaml.safe_load((REPO / "configs/full/sdxl.yaml").read_text()))  # fmt: skip
    data["models"]["sdxl"] = {**TINY_SDXL, "cross_attention_dim": 2048, "projection_class_embeddings_input_dim": 1328}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return parse_params(data)


def test_nf4_holds_its_linears_in_half_a_byte_and_keeps_no_bf16_copy(tmp_path):
    params = _sdxl_params(tmp_path)
    plain, nf4 = measure_setup(params, "sdxl_attention"), measure_setup(params, "sdxl_nf4")
    sdxl = family("sdxl")
    unet = sdxl.build(sdxl.config(params.models.denoiser_spec), seed=0)
    linears = sum(m.weight.numel() for m in unet.modules() if type(m) is torch.nn.Linear and m.weight.numel() % 64 == 0)
    assert plain.frozen_bytes - nf4.frozen_bytes == pytest.approx(linears * (4 - NF4_BYTES_PER_WEIGHT))
    assert sum(nf4.profile.kept_fixed.values()) < sum(plain.profile.kept_fixed.values())
    assert nf4.profile.kept_per_sample == plain.profile.kept_per_sample and nf4.trainable == plain.trainable
    assert plain.latent_hw == (128, 128)  # px1024's largest bucket, 1024², through SD's VAE


def test_an_int8_base_holds_its_linears_in_a_byte_and_a_row_scale_and_keeps_the_fp32_bases_copies(tmp_path):
    """torchao's int8 weight-only linear keeps its dequantised weight for the backward (measured on a real layer in
    the module docstring): the profile is the fp32 base's; only the frozen bytes shrink, by arithmetic."""
    params = _sdxl_params(tmp_path)
    plain, int8 = measure_setup(params, "sdxl_attention"), measure_setup(params, "sdxl_int8")
    sdxl = family("sdxl")
    unet = sdxl.build(sdxl.config(params.models.denoiser_spec), seed=0)
    linears = [m.weight for m in unet.modules() if type(m) is torch.nn.Linear]
    assert plain.frozen_bytes - int8.frozen_bytes == sum(3 * w.numel() - 4 * w.shape[0] for w in linears)
    assert int8.profile.kept_fixed == plain.profile.kept_fixed  # the bf16 copies stay
    assert int8.profile.kept_per_sample == plain.profile.kept_per_sample and int8.trainable == plain.trainable


def test_a_bf16_base_is_measured_held_so_and_keeps_no_cast_copy(tmp_path):
    params = _sdxl_params(tmp_path)
    plain, half = measure_setup(params, "sdxl_attention"), measure_setup(params, "sdxl_bf16")
    sdxl = family("sdxl")
    unet = sdxl.build(sdxl.config(params.models.denoiser_spec), seed=0)
    layers = sum(m.weight.numel() for m in unet.modules() if type(m) in (torch.nn.Linear, torch.nn.Conv2d))
    assert plain.frozen_bytes - half.frozen_bytes == layers * 2  # their weights in 2 bytes instead of 4
    assert sum(half.profile.kept_fixed.values()) < sum(plain.profile.kept_fixed.values())
    assert half.trainable == plain.trainable


def test_the_cli_forecasts_every_adapter_phase_of_the_sdxl_overlay(tmp_path, capsys):
    _sdxl_params(tmp_path)
    assert preflight_main(["--params", str(tmp_path / "params.yaml"), "--overlay", "none", "--memory"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    rows = json.loads(out[-2])["memory"]
    assert [r["phase"] for r in rows] == ["sdxl_attention", "sdxl_text_encoders", "sdxl_dora", "sdxl_nf4", "sdxl_bf16",
                                          "sdxl_int8"]  # fmt: skip
    by = {r["phase"]: r for r in rows}
    assert by["sdxl_text_encoders"]["trainable"] > by["sdxl_attention"]["trainable"]  # the encoders' LoRA
    assert by["sdxl_text_encoders"]["peak_b1_gib"] > by["sdxl_attention"]["peak_b1_gib"]
    assert by["sdxl_nf4"]["frozen_gib"] < by["sdxl_attention"]["frozen_gib"]
    assert 1.4 < by["sdxl_attention"]["text_encoders_gib"] < 1.6  # CLIP-L + bigG, 818 M weights in bf16
    assert by["sdxl_nf4"]["frozen_gib"] < by["sdxl_int8"]["frozen_gib"] < by["sdxl_bf16"]["frozen_gib"]
    assert by["sdxl_bf16"]["frozen_gib"] < by["sdxl_attention"]["frozen_gib"]
    assert out[-1].startswith("RESULT name=preflight_memory ok=true phases=6 family=sdxl")
    assert any(line.startswith("| sdxl_dora | dora r32") for line in out)


def test_a_full_phase_holds_every_weight_with_its_posthoc_profiles_and_the_cli_forecasts_each_phase(tmp_path, capsys):
    """configs/full/mmdit.yaml has no adapter phase: ``--memory`` forecasts every phase, each holding all of the
    denoiser's weights as trained (fp32 weight, AdamW's two moments, the EMA, and phase 1's two post-hoc profiles)."""
    data = merged(yaml.safe_load((REPO / "configs/full/params.yaml").read_text()),
                  yaml.safe_load((REPO / "configs/full/mmdit.yaml").read_text()))  # fmt: skip
    tiny = yaml.safe_load((REPO / "configs/demo-mmdit/overlay.yaml").read_text())["models"]["mmdit"]
    data["models"]["mmdit"] = {**tiny, "joint_attention_dim": 2048, "pooled_projection_dim": 2048, "sample_size": 64,
                               "pos_embed_max_size": 96}  # fmt: skip
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    params = parse_params(data)
    phase1 = measure_setup(params, "phase1")
    weights = sum(p.numel() for p in family("mmdit").build(family("mmdit").config(params.models.denoiser_spec),
                                                          seed=0).parameters())  # fmt: skip
    assert phase1.trainable == weights and phase1.frozen_bytes == 0 and phase1.setup == "every weight"
    assert phase1.trained_bytes == weights * (16 + 4 * len(params.train.posthoc_sigma_rels))
    assert phase1.latent_hw == (64, 64)  # px512's largest bucket, 512², through SD's VAE
    assert preflight_main(["--params", str(tmp_path / "params.yaml"), "--overlay", "none", "--memory",
                           "--phase", "phase0", "--phase", "phase1"]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-2])["memory"]
    assert [r["phase"] for r in rows] == ["phase0", "phase1"] and rows[0]["latent"] == "32x32"  # 256²
    assert rows[0]["peak_b1_gib"] < rows[1]["peak_b1_gib"]  # a quarter of the tokens


def test_a_controlnet_phase_trains_the_controlnet_beside_the_frozen_unet_and_the_cli_forecasts_it(tmp_path, capsys):
    """configs/full/controlnet.yaml's Canny phase (with a tiny UNet layout): the trained weights are exactly the
    ControlNet that ``ControlNetModel.from_unet`` copies, the UNet is held frozen in fp32, both networks' activations
    are measured (more per sample than the UNet's alone), and ``--memory`` forecasts it without ``--phase``."""
    data = merged(yaml.safe_load((REPO / "configs/full/params.yaml").read_text()),
                  yaml.safe_load((REPO / "configs/full/controlnet.yaml").read_text()))  # fmt: skip
    data["models"]["unet"] = {**yaml.safe_load((REPO / "params.yaml").read_text())["models"]["unet"],
                              "addition_embed_type": None, "sample_size": 64}  # fmt: skip
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    params = parse_params(data)
    unet_family = family("unet")
    unet = unet_family.build(unet_family.config(params.models.denoiser_spec), seed=0)
    controlled = unet_family.controlled(unet, 8, 0, 1.0)
    canny, plain = measure_setup(params, "phase8_canny"), measure_setup(params, "phase7")
    assert canny.trainable == sum(p.numel() for p in controlled.controlnet.parameters())
    assert canny.frozen_bytes == 4 * sum(p.numel() for p in unet.parameters())
    assert canny.trained_bytes == canny.trainable * 16  # weight, AdamW's two moments, the EMA; no post-hoc profiles
    assert canny.setup == "canny ControlNet on the frozen unet" and canny.latent_hw == (64, 64)
    assert sum(canny.profile.kept_per_sample.values()) > sum(plain.profile.kept_per_sample.values())
    assert preflight_main(["--params", str(tmp_path / "params.yaml"), "--overlay", "none", "--memory"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-2])["memory"]
    assert [r["phase"] for r in rows] == ["phase8_canny"] and rows[0]["trainable"] == canny.trainable
