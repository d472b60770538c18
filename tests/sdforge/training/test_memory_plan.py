"""``train.activation_checkpointing`` / ``memory_budget_gib``: the checkpoint units and what they keep
(:mod:`model.activation_memory`), the forecast against the peaks measured on H100/H200s, and the choices ``auto``
makes for 24, 32 and 80 GiB cards at full size (:mod:`sdforge.training.memory_plan`; docs/MEMORY.md)."""

from __future__ import annotations

import pytest
import torch

from model.activation_memory import OUTSIDE, checkpoint_units, measure_profile, set_checkpointing
from model.denoisers import family
from sdforge.config import Train
from sdforge.io import InputError
from sdforge.training.memory_plan import GIB, cap_device_memory, peak_bytes, plan_memory, saving_order
from tests.fixtures.sd15_profile import measure, stored
from tests.fixtures.training import TRAIN_UNET

SD15_PARAMS = 859_520_964
SD15_STATE = 16 * SD15_PARAMS  # fp32 weights, EMA, AdamW's two moments
SD15_UNITS = ["down_blocks.0", "down_blocks.1", "down_blocks.2", "down_blocks.3", "up_blocks.0", "up_blocks.1",
              "up_blocks.2", "up_blocks.3", "mid_block"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    """The tests' tiny UNet and a forward of it at batch ``b`` (16×16 latents)."""
    denoiser = family("unet")
    unet = denoiser.build(denoiser.config(TRAIN_UNET), seed=0).train()
    rows, width = denoiser.cond_shape(dict(unet.config), 8)

    def forward_at(batch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, 4, 16, 16, generator=gen)
        cond = torch.randn(batch, rows, width, generator=gen)
        return denoiser.predict(unet, x, torch.full((batch,), 500.0), cond).float().pow(2).mean()

    return unet, forward_at


def test_the_units_are_the_unets_blocks_and_checkpointing_sets_only_the_named_ones(tiny):
    unet, _ = tiny
    units = checkpoint_units(unet)
    assert list(units) == [f"down_blocks.{i}" for i in range(len(unet.down_blocks))] + [
        f"up_blocks.{i}" for i in range(len(unet.up_blocks))] + ["mid_block"]  # fmt: skip
    assert set_checkpointing(unet, ["down_blocks.0"]) == ["down_blocks.0"]
    flags = {n: m.gradient_checkpointing for n, m in unet.named_modules() if hasattr(m, "gradient_checkpointing")}
    assert {n for n, on in flags.items() if on} == {n for n in flags if n.startswith("down_blocks.0")}
    with pytest.raises(KeyError, match="no checkpoint unit"):
        set_checkpointing(unet, ["down_blocks.9"])
    set_checkpointing(unet, "off")


def test_checkpointing_any_units_leaves_the_gradients_bit_identical(tiny):
    """Non-reentrant recompute on a CPU: off, selective and full give the same loss and gradients, bit for bit."""
    unet, forward_at = tiny
    grads = {}
    for setting in ("off", ["up_blocks.1"], "full"):
        set_checkpointing(unet, setting)
        unet.zero_grad(set_to_none=True)
        forward_at(2).backward()
        grads[str(setting)] = [p.grad.clone() for p in unet.parameters()]
    set_checkpointing(unet, "off")
    reference = grads.pop("off")
    for name, got in grads.items():
        assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True)), name


def test_a_checkpointed_unit_keeps_its_inputs_only(tiny):
    """Measured at batch 1 and 2: every unit keeps activations per sample, far less once checkpointed; nothing is
    counted twice (the sum over units equals one whole-forward count)."""
    unet, forward_at = tiny
    profile = measure_profile(unet, forward_at)
    assert profile.units == list(checkpoint_units(unet))
    for unit in profile.units:
        assert profile.kept_per_sample[unit] > 0
        assert profile.checkpointed_per_sample[unit] < 0.5 * profile.kept_per_sample[unit], unit
    assert profile.checkpointed_per_sample[OUTSIDE] == profile.kept_per_sample[OUTSIDE]
    assert sum(profile.forward_flops.values()) > 0 and all(profile.forward_flops[u] > 0 for u in profile.units)
    assert not any(m.gradient_checkpointing for m in checkpoint_units(unet).values())  # put back as it was


def test_the_forecast_matches_the_peaks_measured_on_hopper_cards():
    """SD1.5 at 64×64 latents, eager: the forecast against bench/README.md's measured peaks (H100/H200, bf16):
    no checkpointing 52.2 GiB at 32 and 89.8 at 64; every block checkpointed 19.7 at 24, 21.5 at 32, 29.9 at 64."""
    profile = stored()
    measured = {((), 32): 52.2, ((), 64): 89.8, (tuple(SD15_UNITS), 24): 19.7, (tuple(SD15_UNITS), 32): 21.5,
                (tuple(SD15_UNITS), 64): 29.9}  # fmt: skip
    for (units, micro), gib in measured.items():
        forecast = peak_bytes(profile, SD15_STATE, units, micro) / GIB
        assert forecast == pytest.approx(gib, rel=0.04), (len(units), micro, forecast)


@pytest.mark.parametrize(
    ("card", "micro", "checkpointed"),
    [
        (24, 32, SD15_UNITS),  # all nine blocks, micro-batch 32 × 2 accumulation
        (32, 32, ["down_blocks.0", "up_blocks.3", "down_blocks.1", "up_blocks.2"]),
        (80, 64, ["down_blocks.0", "up_blocks.3"]),  # the 64×64 level only, no accumulation
    ],
)
def test_auto_at_full_size_picks_the_documented_choice_for_each_card(card, micro, checkpointed):
    """docs/MEMORY.md's table: SD1.5, 64 samples per rank (the MLPerf-like batch), replicated, eager forecast."""
    plan = plan_memory("auto", SD15_UNITS, stored(), SD15_STATE, card * GIB, 64, 64)
    assert (plan.micro, sorted(plan.checkpointed)) == (micro, sorted(checkpointed)), plan.why
    assert plan.peak_bytes <= 0.9 * card * GIB


def test_selective_and_the_fixed_settings():
    profile = stored()
    assert saving_order(profile)[:2] == ["down_blocks.0", "up_blocks.3"]  # the 64×64 level saves most per FLOP
    selective = plan_memory("selective", SD15_UNITS, profile, SD15_STATE, 32 * GIB, 24, 24)
    assert (selective.micro, selective.checkpointed) == (24, ("down_blocks.0", "up_blocks.3", "down_blocks.1"))
    unbudgeted = plan_memory("selective", SD15_UNITS, profile, SD15_STATE, None, 24, 24)
    assert unbudgeted.checkpointed == ("down_blocks.0", "up_blocks.3")  # within a third of the forward's FLOPs
    assert plan_memory("auto", SD15_UNITS, profile, SD15_STATE, None, 24, 24).checkpointed == ()  # a CPU
    full = plan_memory("full", SD15_UNITS, None, SD15_STATE, None, 64, 24)
    assert (full.checkpointed, full.micro) == (tuple(SD15_UNITS), 24)
    with pytest.raises(InputError, match=r"memory_budget_gib \(14\.0 GiB.*train\.parallel: fsdp"):
        plan_memory("auto", SD15_UNITS, profile, SD15_STATE, 14 * GIB, 64, 64)  # the state alone is 12.8 GiB


def test_the_older_key_reads_as_the_new_one():
    """``gradient_checkpointing`` (params files before ``activation_checkpointing``) still loads."""
    assert Train(gradient_checkpointing=True).activation_checkpointing == "full"
    assert Train(gradient_checkpointing=False).activation_checkpointing == "off"
    with pytest.raises(ValueError, match="disagree"):
        Train(gradient_checkpointing=True, activation_checkpointing="auto")


@pytest.mark.slow  # ~2 min on 2 cores: the full-size UNet measured again
def test_the_stored_profile_is_what_the_probe_measures():
    ours, theirs = measure(), stored()
    for field in ("kept_per_sample", "checkpointed_per_sample", "forward_flops"):
        a, b = getattr(ours, field), getattr(theirs, field)
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-6) for k in a), field



def test_a_budget_on_cuda_is_the_allocators_hard_limit(monkeypatch):
    """32 GiB on a pretend 80-GiB card: the fraction 0.4 is set for that device; no budget, or a CPU: nothing."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: calls.append((f, device)))
    cuda = torch.device("cuda", 0)
    assert cap_device_memory(Train(memory_budget_gib=32), cuda) == pytest.approx(0.4)
    assert calls == [(pytest.approx(0.4), cuda)]
    assert cap_device_memory(Train(memory_budget_gib=120), cuda) == 1.0  # never above the card
    assert cap_device_memory(Train(), cuda) is None
    assert cap_device_memory(Train(memory_budget_gib=32), torch.device("cpu")) is None
    assert len(calls) == 2
