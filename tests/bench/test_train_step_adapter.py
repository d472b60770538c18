"""``bench.train_step`` on an adapter phase (the SDXL LoRA step of ``bench/gpu/run.sh``): the overlay and phase it
loads, and ours and diffusers' LoRA script body training the same weights."""

from __future__ import annotations

import pytest
import torch

from bench import train_step
from model.denoisers import family
from sdforge.training.model_setup import add_unet_adapter

SDXL_OVERLAY = train_step.REPO / "configs/full/sdxl.yaml"


def test_the_full_sdxl_overlay_gives_the_phase_and_its_1024px_unet():
    loaded = train_step._load("full", SDXL_OVERLAY)
    params = train_step.with_phase(loaded, "sdxl_bf16")
    assert params.models.denoiser.family == "sdxl" and params.models.denoiser_spec["sample_size"] == 128
    assert list(params.phases) == ["sdxl_bf16"]
    adapter = params.phases["sdxl_bf16"].adapter
    assert (adapter.type, adapter.rank, adapter.base_precision, adapter.targets) == ("lora", 32, "bf16",
                                                                                      ["self_attention"])
    with pytest.raises(KeyError, match="sdxl_attention"):
        train_step.with_phase(loaded, "sdxl_nope")


def _trained(module: torch.nn.Module) -> dict[str, torch.Size]:
    """The trained weights' shapes by module path (peft's adapter name dropped)."""
    return {n.replace(".default", ""): p.shape for n, p in module.named_parameters() if p.requires_grad}


def test_ours_and_the_plain_lora_loop_train_the_same_weights(monkeypatch):
    params = train_step.with_phase(train_step._load("demo-sdxl"), "phase8")
    phase, fam = params.phases["phase8"], family("sdxl")
    ours = train_step._build_unet(params, torch.device("cpu"), False, False,
                                  lambda unet: add_unet_adapter(unet, phase.adapter, fam))  # fmt: skip
    built = []
    build = train_step._build_unet
    monkeypatch.setattr(train_step, "_build_unet", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    step = train_step._plain(params, torch.device("cpu"), 2, False)
    plain = built[0]
    assert _trained(ours) == _trained(plain) and len(_trained(ours)) == 64  # A and B of 32 layers
    assert sum(s.numel() for s in _trained(ours).values()) == 36864
    before = {n: p.detach().clone() for n, p in plain.named_parameters()}
    step(torch.randn(2, 4, 16, 16))
    changed = {n for n, p in plain.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)  # the frozen UNet stays as it was
