"""The phase's trained model, built: the init weights (``init_from``, ``init_path``), its adapter, the speed
switches (channels_last, ``train.compile``; activation checkpointing is the job's memory plan,
:mod:`sdforge.training.memory_plan`, measured here first) and the ranks' layout (``train.parallel``), in its
strategy object (:mod:`sdforge.training.trained_model`, :mod:`sdforge.training.sharded_model`)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch

from model.activation_memory import ActivationProfile, measure_profile
from model.adapters import add_adapter, count_parameters, lora_config, target_pattern
from model.denoisers import DenoiserFamily, family
from model.learned_words import LearnedWords
from model.precision import uses_bf16_autocast
from model.quantization import QUANTISED, held_bytes, quantisation_error, quantise_linears
from model.sharding import shard_model
from model.speed import compile_unet
from sdforge.config import SCRATCH, Adapter, Params, Phase
from sdforge.io import InputError
from sdforge.training.controlnet_model import ControlNetUNet, attach_controlnet
from sdforge.training.distributed import Dist
from sdforge.training.parallel import choose_sharding, ensure_process_group
from sdforge.training.sharded_model import ShardedUNet
from sdforge.training.trained_model import AdapterUNet, FullUNet
from sdforge.training.unet_init import load_foreign_weights, load_init_unet

log = logging.getLogger(__name__)

PROFILED = ("auto", "selective")
"""The ``train.activation_checkpointing`` settings that measure the model's activations first."""
PROBE_TOKENS = 77
"""Text tokens of the probe's conditioning (CLIP's)."""


def build_trained_model(
    params: Params,
    phase: Phase,
    dist: Dist,
    bucket_shapes: int = 1,
    words: LearnedWords | None = None,
    blockers: tuple[str, ...] = (),
    latent_hw: tuple[int, int] | None = None,
    vae_factor: int = 8,
    text_lora: dict[str, torch.nn.Module] | None = None,
) -> FullUNet:
    """The phase's starting UNet (``init_from``, then ``init_path``, then its adapter if any) on the device, set up
    for training (channels_last, ``train.compile`` for ``bucket_shapes`` shapes), in its
    strategy object; an adapter phase's learned ``words`` (the text encoder's rows) and its text encoders' LoRA
    (``text_lora``, by folder name) train with it. Sharded over the
    ranks (:class:`ShardedUNet`) where ``train.parallel`` says so (:mod:`sdforge.training.parallel`; ``blockers``:
    what of the phase sharding does not support). With ``train.activation_checkpointing`` ``auto`` or
    ``selective``, its activations are measured first at ``latent_hw`` (its ``activation_profile``; checkpointing
    itself is set by the job's memory plan, :mod:`sdforge.training.memory_plan`). A ControlNet phase's UNet is
    frozen under a new ControlNet for images ``vae_factor``× its latents (:class:`ControlNetUNet`)."""
    cfg = params.train
    init_dir = Path(params.paths.checkpoints) / phase.init_from
    weights = "live" if phase.init_from == SCRATCH else phase.init_weights
    denoiser_family = family(params.models.denoiser.family)
    unet = load_init_unet(init_dir, weights, params.models.denoiser_spec, denoiser_family)
    if phase.init_path:
        load_foreign_weights(unet, Path(phase.init_path))
    sharded = choose_sharding(cfg.parallel, sum(p.numel() for p in unet.parameters()), dist, list(blockers))
    if sharded:
        ensure_process_group(dist)
    if phase.adapter is not None:
        add_unet_adapter(unet, phase.adapter, denoiser_family)
    if phase.controlnet is not None:
        unet = attach_controlnet(unet, phase.controlnet, denoiser_family, vae_factor, cfg.seed)
    unet.to(dist.device).train()
    bf16 = uses_bf16_autocast(dist.device, cfg.mixed_precision)
    profile = None
    if cfg.activation_checkpointing in PROFILED and latent_hw is not None:  # before compile and sharding
        profile = activation_profile(unet, denoiser_family, dist.device, bf16, latent_hw, vae_factor)
    if cfg.channels_last:
        unet.to(memory_format=torch.channels_last)
    compiled = compile_unet(unet, cfg.compile, bucket_shapes)
    if compiled:
        log.info("train.compile: %s — %d module(s) compiled at their first step", cfg.compile, compiled)
    if sharded:
        units = shard_model(unet, denoiser_family.shard_blocks, dist.device, bf16)
        log.info("train.parallel: fsdp — %d unit(s) sharded over %d rank(s) (parameters %s, gradients reduced in "
                 "fp32)", units, dist.world, "bf16" if bf16 else "fp32")  # fmt: skip
        model = ShardedUNet(unet, dist, units)
    else:
        model = _replicated(unet, phase, dist, words, text_lora or {})
    model.activation_profile = profile
    return model


def _replicated(unet: torch.nn.Module, phase: Phase, dist: Dist, words: LearnedWords | None,
                text_lora: dict[str, torch.nn.Module]) -> FullUNet:  # fmt: skip
    """The strategy of a phase whose every rank holds the whole model: a ControlNet, an adapter, or every weight."""
    if phase.controlnet is not None:
        return ControlNetUNet(unet, dist, phase.controlnet)
    if phase.adapter is None:
        return FullUNet(unet, dist)
    return AdapterUNet(unet, dist, phase.adapter, words, text_lora)


def activation_profile(unet: torch.nn.Module, denoiser_family: DenoiserFamily, device: torch.device, bf16: bool,
                       latent_hw: tuple[int, int], vae_factor: int = 8) -> ActivationProfile:  # fmt: skip
    """What ``unet`` keeps for the backward per checkpoint unit (:func:`model.activation_memory.measure_profile`):
    its training forward at batch 1 and 2 on ``device``, ``latent_hw`` latents and random conditioning (and an
    empty conditioning image ``vae_factor``× their size for a ControlNet), outside the run's random streams."""
    rows, width = denoiser_family.cond_shape(dict(unet.config), PROBE_TOKENS)
    channels = denoiser_family.latent_channels(unet)

    def forward_at(batch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(batch, channels, *latent_hw, generator=gen).to(device)
        cond = torch.randn(batch, rows, width, generator=gen).to(device)
        t = torch.full((batch,), 500.0, device=device)
        image = torch.zeros(batch, 3, latent_hw[0] * vae_factor, latent_hw[1] * vae_factor, device=device)
        control = unet.conditioned(image) if hasattr(unet, "conditioned") else contextlib.nullcontext()
        with control, torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            return denoiser_family.predict(unet, x, t, cond).float().pow(2).mean()

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        profile = measure_profile(unet, forward_at)
    log.info("activations per sample at %dx%d latents: %.3f GiB kept, %.3f GiB with every unit checkpointed",
             *latent_hw, sum(profile.kept_per_sample.values()) / 2**30,
             sum(profile.checkpointed_per_sample.values()) / 2**30)  # fmt: skip
    return profile


def add_unet_adapter(unet: torch.nn.Module, spec: Adapter, denoiser_family: DenoiserFamily) -> None:
    """Freeze ``unet`` and add the phase's LoRA/DoRA on the family's target groups (:mod:`model.adapters`); log
    trainable vs total weights."""
    pattern = target_pattern(spec.targets, denoiser_family.lora_groups)
    config = lora_config(spec.type, spec.rank, spec.alpha, spec.dropout, pattern)
    if spec.base_precision in QUANTISED:
        before = {k: v.detach().clone() for k, v in unet.state_dict().items()}
        try:
            layers = quantise_linears(unet, spec.base_precision)
        except ImportError as err:
            raise InputError(f"adapter.base_precision {spec.base_precision} needs torchao ({err}): pip install -e "
                             "'.[qlora]' (docs/SDXL.md \"A quantised base\")") from None  # fmt: skip
        error = quantisation_error(before, unet)
        unet.sdforge_quantisation = {"layers": len(layers), **error}
        log.info("adapter.base_precision %s: %d layers held so (max |error| %.3g, relative %.3g); the frozen "
                 "UNet holds %.1f MiB", spec.base_precision, len(layers), error["max_abs_error"], error["rel_error"],
                 sum(held_bytes(t) for t in unet.state_dict().values()) / 2**20)  # fmt: skip
    add_adapter(unet, config)
    n_train, n_base = count_parameters(unet)
    log.info(
        "%s adapter rank %d on %s: %d trainable weights, %.2f %% of the UNet's %d",
        spec.type, spec.rank, ", ".join(spec.targets), n_train, 100 * n_train / n_base, n_base,
    )  # fmt: skip
