"""``train.activation_checkpointing: auto`` under a ``memory_budget_gib`` that the configured micro-batch does not fit:
the train stage measures the model's activations, checkpoints every block, halves the micro-batch and doubles the
accumulation (the global batch kept), and trains like the straight run (docs/MEMORY.md)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from model.activation_memory import checkpoint_units
from model.denoisers import family
from model.precision import uses_bf16_autocast
from sdforge.config import load_params
from sdforge.latents.loader import LatentIndexDataset
from sdforge.training.memory_plan import GIB, USABLE_SHARE, peak_bytes
from sdforge.training.model_setup import activation_profile
from tests.fixtures.training import DDP_MAX_ABS_DIFF, edit_params, train, weights


def _budget_for_micro(params_file: Path, micro: int) -> tuple[float, int]:
    """A budget (GiB) that holds the phase's model with every unit checkpointed at ``micro`` and nothing more: what
    the trainer's own probe and forecast say, computed here the same way; and the model's number of units."""
    params = load_params(params_file)
    paths, denoiser = params.paths, family(params.models.denoiser.family)
    unet = denoiser.build(denoiser.config(params.models.denoiser_spec), seed=0).train()
    index = Path(paths.mixes) / "phase1.parquet"
    data = LatentIndexDataset(index, Path(paths.latents), params.phase_resolution("phase1"))
    shape = max(data.latent_shapes.values(), key=lambda s: s[-1] * s[-2])
    bf16 = uses_bf16_autocast(torch.device("cpu"), params.train.mixed_precision)
    profile = activation_profile(unet, denoiser, torch.device("cpu"), bf16, tuple(shape[-2:]))
    state = 16 * sum(p.numel() for p in unet.parameters())
    units = tuple(checkpoint_units(unet))
    return peak_bytes(profile, state, units, micro) * 1.001 / USABLE_SHARE / GIB, len(units)


def test_auto_fits_a_small_budget_by_checkpointing_and_accumulating(fresh_workspace, straight_phase1):
    """The straight run: micro-batch 8 × accumulation 2. Under a budget that holds 4 with every block checkpointed:
    4 × 4, the same 16 samples per step, weights within the DDP tolerance of the straight run."""
    params = fresh_workspace
    budget, units = _budget_for_micro(params, 4)
    edit_params(params, "train", activation_checkpointing="auto", memory_budget_gib=budget)
    done = train(params, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "micro-batch 4: forecast peak" in done.stderr
    metrics = json.loads((params.parent / "metrics/train/phase1.json").read_text())
    straight = json.loads((straight_phase1 / "metrics/train/phase1.json").read_text())
    assert (metrics["memory.micro_batch_cap"], metrics["global_batch"], metrics["steps"]) == (
        4, straight["global_batch"], straight["steps"])  # fmt: skip
    assert metrics["memory.checkpointed_units"] == units and metrics["memory.forecast_peak_gib"] <= budget
    for sub in ("unet", "unet_ema"):
        a, b = weights(params.parent, "phase1", sub), weights(straight_phase1, "phase1", sub)
        diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        assert diff <= DDP_MAX_ABS_DIFF, f"{sub}: differs from the straight run by {diff:.3g}"
