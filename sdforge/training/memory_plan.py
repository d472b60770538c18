"""``train.activation_checkpointing`` and ``train.memory_budget_gib``: which checkpoint units recompute in the
backward, and the micro-batch, so that a rank's peak memory fits its budget (docs/MEMORY.md).

The forecast of a rank's peak, in bytes, for micro-batch ``b`` with the units ``S`` checkpointed::

    state + Σ_u fixed_u(S) + b · Σ_u per_sample_u(S) · factor(u ∈ S)

- ``state``: the fp32 weights, the EMA and AdamW's two moments (16 bytes per parameter; post-hoc EMA profiles 4
  more each), divided by the world size when sharded. Gradients are left out: the backward allocates them as it
  frees activations, and the two measured lines below hold with them left out.
- ``fixed_u`` / ``per_sample_u``: what unit ``u`` keeps for the backward (:class:`model.activation_memory.
  ActivationProfile`, measured on the model itself at batch 1 and 2 before training starts): autocast's
  low-precision weight copies, and the activations per sample.
- ``factor``: the backward's working memory on top of what the forward keeps (the activations' gradients, a
  checkpointed block's recomputed activations), fitted to the two lines measured for the SD1.5 UNet at 64×64
  latents on an H100/H200 (bench/README.md: peak 14.6 + 1.175·b GiB eager without checkpointing, 13.1 + 0.2625·b
  with full checkpointing): 1.175 / 0.876 and 0.2625 / 0.144 (the CPU-measured per-sample GiB). Other models and
  sizes are forecasts from the same factors until a GPU measures them.

``auto`` weighs each choice by a forecast speed: the step's efficiency at micro-batch ``b``, ``b / (b + 6)`` (a fit
to the eager and compiled img/s at 32, 48 and 64), times ``1 − 0.2 · (recomputed FLOPs share)`` (full checkpointing
measured 18–20 % slower); it picks the fastest that fits, among prefixes of the units ordered by activation bytes
saved per recomputed FLOP (the 64×64 level first), at micro-batches that divide the rank's share of the global
batch. The global batch is kept through accumulation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from model.activation_memory import OUTSIDE, ActivationProfile
from sdforge.io import InputError

log = logging.getLogger(__name__)

STATE_BYTES_PER_PARAM = 16
"""fp32 weights, the EMA's shadow weights and AdamW's two moments (gradients: see the module's docstring)."""
FACTOR_KEPT = 1.175 / 0.876
FACTOR_CHECKPOINTED = 0.2625 / 0.144
"""The backward's working memory over what the forward keeps, per sample (fitted: module docstring)."""
BATCH_HALF = 6
RECOMPUTE_COST = 0.2
USABLE_SHARE = 0.9
"""Of the budget, what the forecast may fill: the allocator's fragmentation and CUDA's own context take the rest."""
SELECTIVE_SHARE = 1 / 3
"""``selective`` without a budget: the recompute stays within this share of the forward's FLOPs."""
GIB = 2**30


@dataclass(frozen=True)
class MemoryPlan:
    """The checkpointed units and the micro-batch cap of one rank, with the forecast that chose them."""

    checkpointed: tuple[str, ...]
    micro: int
    peak_bytes: float | None
    speed: float | None
    why: str


def saving_order(profile: ActivationProfile) -> list[str]:
    """The units by activation bytes saved per recomputed FLOP, most first."""
    def saved_per_flop(unit: str) -> float:
        saved = profile.kept_per_sample[unit] - profile.checkpointed_per_sample[unit]
        return saved / max(profile.forward_flops[unit], 1.0)

    return sorted(profile.units, key=saved_per_flop, reverse=True)


def peak_bytes(profile: ActivationProfile, state_bytes: float, checkpointed: tuple[str, ...], micro: int) -> float:
    """The forecast peak of a rank (module docstring)."""
    total = state_bytes
    for unit in profile.kept_per_sample:
        if unit in checkpointed and unit != OUTSIDE:
            fixed, per_sample = profile.checkpointed_fixed[unit], profile.checkpointed_per_sample[unit]
            total += fixed + micro * per_sample * FACTOR_CHECKPOINTED
        else:
            total += profile.kept_fixed[unit] + micro * profile.kept_per_sample[unit] * FACTOR_KEPT
    return total


def speed(profile: ActivationProfile, checkpointed: tuple[str, ...], micro: int) -> float:
    """The forecast throughput of a choice, relative (module docstring)."""
    recomputed = sum(profile.forward_flops[u] for u in checkpointed) / max(sum(profile.forward_flops.values()), 1.0)
    return micro / (micro + BATCH_HALF) * (1 - RECOMPUTE_COST * recomputed)


def plan_memory(setting: str, units: list[str], profile: ActivationProfile | None, state_bytes: float,
                budget_bytes: float | None, per_rank: int, batch_size: int) -> MemoryPlan:  # fmt: skip
    """The plan for ``train.activation_checkpointing`` = ``setting`` on a rank whose model has the checkpoint
    ``units``, holding ``state_bytes`` of training state, ``per_rank`` samples of each global batch and at most
    ``batch_size`` (``phases.<p>.batch_size``) per micro-batch. ``profile`` and ``budget_bytes`` are read by
    ``selective`` and ``auto`` only (an InputError naming the keys when no choice fits)."""
    if setting in ("off", "full"):
        return MemoryPlan(tuple(units) if setting == "full" else (), batch_size, None, None, f"{setting} (as set)")
    if profile is None:
        raise ValueError(f"activation_checkpointing {setting} needs the model's measured activation profile")
    order = saving_order(profile)
    prefixes = [tuple(order[:k]) for k in range(len(order) + 1)]
    if budget_bytes is None:
        return _without_budget(setting, profile, prefixes, batch_size)
    usable = USABLE_SHARE * budget_bytes
    if setting == "selective":  # the fewest units that fit the configured micro-batch
        fits = [p for p in prefixes[1:] if peak_bytes(profile, state_bytes, p, batch_size) <= usable]
        return _chosen(profile, state_bytes, fits[0] if fits else None, batch_size, usable, "selective")
    micros = [b for b in range(1, min(batch_size, per_rank) + 1) if per_rank % b == 0]
    options = [(speed(profile, p, b), p, b) for p in prefixes for b in micros
               if peak_bytes(profile, state_bytes, p, b) <= usable]  # fmt: skip
    best = max(options, key=lambda o: (o[0], o[2])) if options else None
    return _chosen(profile, state_bytes, best[1] if best else None, best[2] if best else batch_size, usable, "auto")


def _without_budget(setting: str, profile: ActivationProfile, prefixes: list[tuple[str, ...]],
                    batch_size: int) -> MemoryPlan:  # fmt: skip
    """No budget (a CPU without ``train.memory_budget_gib``): ``auto`` checkpoints nothing; ``selective`` the most
    units, in saving order, whose recompute stays within :data:`SELECTIVE_SHARE` of the forward's FLOPs (one at
    least)."""
    if setting == "auto":
        return MemoryPlan((), batch_size, None, None, "auto: no memory budget (set train.memory_budget_gib): "
                          "nothing checkpointed")  # fmt: skip
    total = max(sum(profile.forward_flops.values()), 1.0)
    within = [p for p in prefixes[1:] if sum(profile.forward_flops[u] for u in p) <= SELECTIVE_SHARE * total]
    units = within[-1] if within else prefixes[1]
    why = f"selective without a memory budget: {list(units)} (their recompute within a third of the forward)"
    return MemoryPlan(units, batch_size, None, speed(profile, units, batch_size), why)


def _chosen(profile: ActivationProfile, state_bytes: float, units: tuple[str, ...] | None, micro: int,
            usable: float, setting: str) -> MemoryPlan:  # fmt: skip
    """The plan of ``units`` at ``micro``; None: nothing fits (an InputError naming the keys and the smallest)."""
    if units is None:
        least = peak_bytes(profile, state_bytes, tuple(profile.units), 1)
        raise InputError(
            f"train.activation_checkpointing {setting}: nothing fits train.memory_budget_gib "
            f"({usable / USABLE_SHARE / GIB:.1f} GiB, {USABLE_SHARE:.0%} of it usable): even every unit checkpointed "
            f"at micro-batch 1 needs {least / GIB:.1f} GiB. Shard the model (train.parallel: fsdp), or raise the "
            "budget on a bigger card"
        )
    peak = peak_bytes(profile, state_bytes, units, micro)
    why = (f"{setting}: {len(units)} of {len(profile.units)} unit(s) checkpointed {list(units)}, micro-batch {micro}: "
           f"forecast peak {peak / GIB:.1f} of {usable / USABLE_SHARE / GIB:.1f} GiB")  # fmt: skip
    return MemoryPlan(units, micro, peak, speed(profile, units, micro), why)


def rank_state_bytes(model, cfg, posthoc: bool) -> float:
    """The training state one rank holds before activations: every weight as stored, and for each trained one its
    EMA (with the model) and AdamW's two moments in fp32, plus the post-hoc EMA's profiles, plus its gradient under
    ``train.cuda_graphs: step`` (kept between steps: the forward's peak holds it too); over the world size when
    sharded. ``model`` is a trained-model strategy object (:mod:`sdforge.training.trained_model`)."""
    weights = sum(p.numel() * p.element_size() for p in model.unet.parameters())
    total = weights + state_bytes_per_trained(cfg, posthoc) * sum(p.numel() for p in model.trainable)
    return total / model.world if model.sharded else total


def state_bytes_per_trained(cfg, posthoc: bool) -> int:
    """What a rank holds for each trained weight besides the weight: AdamW's two moments, the EMA (with the model),
    the post-hoc EMA's profiles when the phase keeps them, and the gradient under ``train.cuda_graphs: step``."""
    per_trained = 8 + (4 if cfg.ema_device == "model" else 0) + (4 * len(cfg.posthoc_sigma_rels) if posthoc else 0)
    return per_trained + (4 if cfg.cuda_graphs == "step" else 0)


def budget_bytes(cfg, device) -> float | None:
    """``train.memory_budget_gib``, else the card's total memory (None on a CPU)."""
    if cfg.memory_budget_gib is not None:
        return cfg.memory_budget_gib * GIB
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return None


def cap_device_memory(cfg, device) -> float | None:
    """On CUDA with ``train.memory_budget_gib`` set: the budget also becomes the caching allocator's hard limit
    (``torch.cuda.set_per_process_memory_fraction``), so a smaller card is emulated, not only planned for (a run
    that outgrows it fails with CUDA's out-of-memory error). The fraction set; None elsewhere."""
    if cfg.memory_budget_gib is None or device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, cfg.memory_budget_gib * GIB / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    log.info("train.memory_budget_gib %.1f: this process may allocate %.0f %% of the %.1f-GiB card",
             cfg.memory_budget_gib, 100 * fraction, total / GIB)  # fmt: skip
    return fraction
