"""Peak GPU memory of a training phase at full size — every weight trained, or an adapter — forecast on a CPU
without the weights (``sdforge preflight --memory``; docs/SDXL.md "Memory at full size", docs/MMDIT.md).

**How.** The phase's denoiser (the configuration's full architecture) and its text encoders are built on ``meta``,
the phase's adapter (if any) is added as training adds it, and every weight becomes a fake CPU tensor
(:func:`model.activation_memory.as_fake_tensors`: shapes and dtypes, no storage). The trainer's own activation probe
(:func:`sdforge.training.model_setup.activation_profile`: the training forward at batch 1 and 2 under bf16 autocast)
then measures what each checkpoint unit keeps for the backward, in seconds and without the memory. On the SD1.5 UNet
the fake measurement equals the real one (``tests/fixtures/sd15_activation_profile.json``) within 0.02 % (test).
:func:`sdforge.training.memory_plan.peak_bytes` — the formula fitted to peaks measured on H100/H200s — turns the
profile into a peak per micro-batch, with nothing or every unit checkpointed.

**What a rank holds**, per setup:

- the frozen denoiser as the trainer holds it: fp32 (``adapter.base_precision: fp32``), bf16 linear and convolution
  weights (``bf16``: held so in the fake model, its activations measured), or NF4 linear weights
  (:data:`model.quantization.NF4_BYTES_PER_WEIGHT`) with the rest fp32;
- its trained tensors (every denoiser weight, or the LoRA/DoRA, the text encoders' LoRA, learned words, or a
  ControlNet's weights, copied from the frozen denoiser it steers as training copies it, the denoiser held in fp32
  beside it): as :func:`sdforge.training.memory_plan.rank_state_bytes` counts them — the fp32 weight, AdamW's two
  moments, the EMA (on the card), the post-hoc EMA's profiles where the phase keeps them (16 B each, 24 B with two
  profiles; the gradients are freed before the forward's peak, as the memory plan counts);
- the text encoders in ``train.text_encoder_dtype`` (bf16 on CUDA) and, when they train a LoRA, what their forward
  keeps for the backward (always kept: checkpointing is the denoiser's);
- the denoiser's activations, measured (with a ControlNet: both networks' forward, under a conditioning image of the
  bucket's pixel size). Under bf16 autocast a frozen fp32 weight's bf16 copy is kept for the
  backward wherever a LoRA upstream needs the gradient to flow through it: that is the profile's fixed part.

**NF4 and int8 are derived, not measured**: torchao's tensors do not run under FakeTensorMode. NF4's linear keeps the
4-bit weight for the backward (``LinearNF4.save_for_backward``), not a bf16 copy, so an NF4 setup is the same
adapter's fp32-base profile with the bf16 copies of the quantised linears taken out of each unit's fixed part. int8's
(torchao 0.18's ``Int8Tensor``, weight-only) keeps the dequantised weight — a bf16 ``[out, in]`` tensor under
autocast, measured with ``saved_tensors_hooks`` on a real layer — so its profile is the fp32 base's as measured and
only the frozen bytes change (1 B a weight and an fp32 scale a row).

Not counted: the CUDA context and the allocator's fragmentation (the memory plan's ``USABLE_SHARE`` leaves 10 % of
the budget for them) and the VAE (latents are precomputed). No GPU has measured an SDXL peak yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from model.activation_memory import (
    OUTSIDE,
    ActivationProfile,
    as_fake_tensors,
    checkpoint_units,
    saved_activation_bytes,
)
from model.adapters import add_adapter, add_text_adapter, lora_config, target_pattern
from model.denoisers import DenoiserFamily, family
from model.quantization import NF4_BLOCK, NF4_BYTES_PER_WEIGHT, quantise_linears
from model.text_stack import text_part_dirs
from sdforge.architectures import build_random_text_encoder
from sdforge.config import Params
from sdforge.ingest.buckets import shapes_of
from sdforge.training.memory_plan import FACTOR_KEPT, GIB, USABLE_SHARE, peak_bytes, state_bytes_per_trained
from sdforge.training.model_setup import PROBE_TOKENS, activation_profile

log = logging.getLogger(__name__)

VAE_FACTOR = 8
"""SD's VAE (and SDXL's, and the 16-channel ones): pixels per latent side."""
BATCH_LIMIT = 64
"""The largest micro-batch the table tries."""


@dataclass(frozen=True)
class SetupMemory:
    """What one training phase holds on a rank at full size, and what its activations cost (bytes)."""

    phase: str
    setup: str
    trainable: int
    frozen_bytes: float
    trained_bytes: float
    text_bytes: float
    text_per_sample: float
    text_fixed: float
    profile: ActivationProfile
    latent_hw: tuple[int, int]

    def peak(self, micro: int, checkpointed: bool) -> float:
        """The forecast peak at micro-batch ``micro``, with every denoiser unit checkpointed or none."""
        units = tuple(self.profile.units) if checkpointed else ()
        held = self.frozen_bytes + self.trained_bytes + self.text_bytes + self.text_fixed
        return peak_bytes(self.profile, held, units, micro) + micro * self.text_per_sample * FACTOR_KEPT

    def largest_batch(self, budget_gib: float, checkpointed: bool) -> int:
        """The largest micro-batch (≤ :data:`BATCH_LIMIT`) whose peak fits ``USABLE_SHARE`` of the budget; 0: none."""
        usable = USABLE_SHARE * budget_gib * GIB
        fits = [b for b in range(1, BATCH_LIMIT + 1) if self.peak(b, checkpointed) <= usable]
        return fits[-1] if fits else 0


def frozen_base_phases(params: Params) -> list[str]:
    """The configuration's phases that train beside a frozen denoiser (an adapter or a ControlNet), in order."""
    return [name for name in params.phase_names()
            if params.phases[name].adapter is not None or params.phases[name].controlnet is not None]  # fmt: skip


def forecast_phases(params: Params) -> list[str]:
    """The phases the forecast models, in order: every phase but a distillation's."""
    return [name for name in params.phase_names() if not unmodelled(params, name)]


def unmodelled(params: Params, phase: str) -> str | None:
    """Why ``phase`` is not forecast (a distillation phase runs its teacher's solve too), or None."""
    spec = params.phases[phase]
    if spec.distill is not None:
        return "a distillation phase (the teacher's solve is not modelled)"
    return None


def trained_bytes_each(params: Params, phase: str) -> int:
    """Bytes a rank holds per trained weight (the fp32 weight and its state), as the trainer's memory plan counts."""
    posthoc = params.phases[phase].posthoc_ema and bool(params.train.posthoc_sigma_rels)
    return 4 + state_bytes_per_trained(params.train, posthoc)


def measure_setup(params: Params, phase: str) -> SetupMemory:
    """The :class:`SetupMemory` of training phase ``phase`` at the largest bucket of its resolution."""
    spec, denoiser_family = params.phases[phase].adapter, family(params.models.denoiser.family)
    latent_hw = largest_latent(params, phase)
    mode = _fake_mode()
    unet = _fake_denoiser(params, denoiser_family, spec, mode, params.phases[phase].controlnet)
    with mode:
        profile = activation_profile(unet, denoiser_family, torch.device("cpu"), True, latent_hw, VAE_FACTOR)
    trainable = sum(p.numel() for p in unet.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in unet.parameters() if not p.requires_grad)
    if spec is not None and spec.base_precision == "nf4":
        profile, frozen = _as_nf4(unet, profile, frozen)
    if spec is not None and spec.base_precision == "int8":
        frozen -= _int8_saving(unet)
    encoders, text_trainable = _fake_text_encoders(params, denoiser_family, spec, mode)
    text_lora = spec is not None and spec.text_encoders
    text_per_sample, text_fixed = _text_activation_bytes(encoders, mode) if text_lora else (0.0, 0.0)
    words = 0 if spec is None else len(spec.words) * sum(int(e.get_input_embeddings().weight.shape[1])
                                                        for e in encoders.values())  # fmt: skip
    trained = trainable + text_trainable + words
    text_bytes = sum(p.numel() * p.element_size() for e in encoders.values() for p in e.parameters()
                     if not p.requires_grad)  # fmt: skip
    setup = describe(spec) if params.phases[phase].controlnet is None else describe_controlnet(params, phase)
    return SetupMemory(phase, setup, trained, frozen, trained * trained_bytes_each(params, phase),
                       text_bytes, text_per_sample, text_fixed, profile, latent_hw)  # fmt: skip


def describe(spec) -> str:
    """A phase's setup in a few words: ``every weight``, or the adapter's type, rank, targets, text encoders, words,
    base precision."""
    if spec is None:
        return "every weight"
    parts = [f"{spec.type} r{spec.rank} on {'+'.join(spec.targets)}"]
    if spec.text_encoders:
        parts.append(f"+ {' + '.join(spec.text_encoders)}")
    if spec.words:
        parts.append(f"+ words {spec.words}")
    if spec.base_precision != "fp32":
        parts.append(f"({spec.base_precision} base)")
    return " ".join(parts)


def describe_controlnet(params: Params, phase: str) -> str:
    """A ControlNet phase's setup in a few words: its condition and the frozen denoiser it steers."""
    return f"{params.phases[phase].controlnet.condition} ControlNet on the frozen {params.models.denoiser.family}"


def largest_latent(params: Params, phase: str) -> tuple[int, int]:
    """The latent size of the largest-area bucket of the phase's resolution (SD's VAE: ÷8)."""
    w, h = max(shapes_of(params.bucket_sets()[params.phase_resolution(phase)]), key=lambda wh: wh[0] * wh[1])
    return h // VAE_FACTOR, w // VAE_FACTOR


def _fake_mode():
    # lazy: a private torch module, only the memory forecast builds fake models
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def _fake_denoiser(params: Params, denoiser_family: DenoiserFamily, spec, mode, controlnet=None) -> torch.nn.Module:
    """The full-size denoiser, every weight trained, or with the phase's adapter (as
    :func:`sdforge.training.model_setup` adds it; a bf16 base held so, a quantised one not: see :func:`_as_nf4`), or
    frozen under the phase's ``controlnet`` (the family's, copied from it as training copies it), as fake CPU tensors
    in train mode."""
    with torch.device("meta"):
        unet = denoiser_family.build(denoiser_family.config(params.models.denoiser_spec), seed=0).requires_grad_(True)
        if spec is not None and spec.base_precision == "bf16":
            quantise_linears(unet, "bf16")
        if spec is not None:
            pattern = target_pattern(spec.targets, denoiser_family.lora_groups)
            add_adapter(unet, lora_config(spec.type, spec.rank, spec.alpha, spec.dropout, pattern))
        if controlnet is not None:
            unet = denoiser_family.controlled(unet.requires_grad_(False), VAE_FACTOR, 0, controlnet.conditioning_scale,
                                              controlnet.embedding_channels)  # fmt: skip
    return as_fake_tensors(unet, mode, torch.device("cpu")).train()


def _fake_text_encoders(params: Params, denoiser_family: DenoiserFamily, spec, mode) -> tuple[dict, int]:
    """The family's full-size text encoders (``models.text_encoder*`` architectures) in ``train.text_encoder_dtype``
    as fake CPU tensors, with the phase's text-encoder LoRA where it has one; and that LoRA's trained weights."""
    import transformers  # lazy: only the memory forecast builds text encoders here

    dtype = torch.bfloat16 if params.train.text_encoder_dtype == "bf16" else torch.float32
    hub_ids = [params.models.text_encoder, params.models.text_encoder_2][: denoiser_family.text_encoders]
    encoders, trained = {}, 0
    parts = zip(text_part_dirs(denoiser_family), denoiser_family.text_encoder_classes, hub_ids, strict=True)
    for (folder, _), class_name, hub_id in parts:
        with torch.device("meta"):
            encoder = build_random_text_encoder(hub_id, 0, getattr(transformers, class_name)).to(dtype)
            if spec is not None and folder in spec.text_encoders:
                trained += sum(p.numel() for _, p in add_text_adapter(encoder, spec.type, spec.rank, spec.alpha,
                                                                      spec.dropout))  # fmt: skip
        encoders[folder] = as_fake_tensors(encoder, mode, torch.device("cpu")).train()
    return encoders, trained


def _text_activation_bytes(encoders: dict, mode) -> tuple[float, float]:
    """What the adapted text encoders' forward keeps for the backward: ``(per sample, fixed)`` bytes."""
    def kept(batch: int) -> float:
        ids = torch.zeros(batch, PROBE_TOKENS, dtype=torch.long)
        total = 0.0
        for encoder in encoders.values():
            def forward(encoder=encoder) -> torch.Tensor:
                out = encoder(ids, output_hidden_states=True)
                return out.hidden_states[-2].float().pow(2).mean() + out[0].float().pow(2).mean()

            total += sum(saved_activation_bytes(encoder, forward).values())
        return total

    with mode:
        one, two = kept(1), kept(2)
    return two - one, 2 * one - two


def _as_nf4(unet: torch.nn.Module, profile: ActivationProfile, frozen: float) -> tuple[ActivationProfile, float]:
    """An fp32-base profile and frozen bytes as the same setup on an NF4 base (module docstring)."""
    units = checkpoint_units(unet)
    copies, quantised = dict.fromkeys(profile.kept_fixed, 0.0), 0
    for name, module in unet.named_modules():
        if type(module) is not torch.nn.Linear or ".lora_" in name or module.weight.numel() % NF4_BLOCK:
            continue
        unit = next((u for u in units if u and name.startswith(f"{u}.")), OUTSIDE)
        copies[unit] = copies.get(unit, 0.0) + 2 * module.weight.numel()  # its bf16 copy under autocast
        quantised += module.weight.numel()
    fixed = {u: max(0.0, v - copies.get(u, 0.0)) for u, v in profile.kept_fixed.items()}
    return replace(profile, kept_fixed=fixed), frozen - quantised * (4 - NF4_BYTES_PER_WEIGHT)


def _int8_saving(unet: torch.nn.Module) -> float:
    """Bytes an int8 base saves on the fp32 one: each frozen linear weight in 1 byte and an fp32 scale per output row
    instead of 4 bytes a weight. Its profile is the fp32 base's: torchao's ``Int8Tensor`` keeps the dequantised weight
    (bf16 under autocast) for the backward, as an fp32 weight keeps its bf16 copy (module docstring)."""
    linears = [m.weight for name, m in unet.named_modules() if type(m) is torch.nn.Linear and ".lora_" not in name]
    return float(sum(w.numel() * 4 - (w.numel() + w.shape[0] * 4) for w in linears))


def memory_rows(setups: list[SetupMemory], budgets_gib: list[float]) -> list[dict]:
    """One row per setup: what it holds (GiB), the peak at micro-batch 1, and the largest micro-batch that fits each
    budget with nothing and with every unit checkpointed."""
    rows = []
    for s in setups:
        row = {"phase": s.phase, "setup": s.setup, "trainable": s.trainable,
               "latent": f"{s.latent_hw[0]}x{s.latent_hw[1]}", "frozen_gib": s.frozen_bytes / GIB,
               "trained_state_gib": s.trained_bytes / GIB, "text_encoders_gib": s.text_bytes / GIB,
               "per_sample_gib": sum(s.profile.kept_per_sample.values()) * FACTOR_KEPT / GIB,
               "peak_b1_gib": s.peak(1, False) / GIB, "peak_b1_checkpointed_gib": s.peak(1, True) / GIB}  # fmt: skip
        for budget in budgets_gib:
            row[f"batch_at_{budget:g}gib"] = s.largest_batch(budget, False)
            row[f"batch_at_{budget:g}gib_checkpointed"] = s.largest_batch(budget, True)
        rows.append(row)
    return rows


def memory_table(rows: list[dict], budgets_gib: list[float]) -> str:
    """The rows as a markdown table."""
    fits = [f"fits {b:g} GiB: batch (none / all checkpointed)" for b in budgets_gib]
    head = ["phase", "setup", "trainable", "frozen denoiser GiB", "trained state GiB", "text encoders GiB",
            "peak at batch 1 GiB (none / all checkpointed)", *fits]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        batches = [f"{r[f'batch_at_{b:g}gib']} / {r[f'batch_at_{b:g}gib_checkpointed']}" for b in budgets_gib]
        cells = [r["phase"], r["setup"], f"{r['trainable']:,}", f"{r['frozen_gib']:.2f}",
                 f"{r['trained_state_gib']:.2f}", f"{r['text_encoders_gib']:.2f}",
                 f"{r['peak_b1_gib']:.1f} / {r['peak_b1_checkpointed_gib']:.1f}", *batches]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
