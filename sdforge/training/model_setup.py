"""The phase's trained model, built: the init weights (``init_from``, ``init_path``), its adapter, the speed
switches (gradient checkpointing, channels_last, ``train.compile``) and the ranks' layout (``train.parallel``), in
its strategy object (:mod:`sdforge.training.trained_model`, :mod:`sdforge.training.sharded_model`)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from model.adapters import add_adapter, count_parameters, lora_config, target_pattern
from model.denoisers import DenoiserFamily, family
from model.learned_words import LearnedWords
from model.precision import uses_bf16_autocast
from model.sharding import shard_model
from model.speed import compile_unet
from sdforge.config import SCRATCH, Adapter, Params, Phase
from sdforge.training.distributed import Dist
from sdforge.training.parallel import choose_sharding, ensure_process_group
from sdforge.training.sharded_model import ShardedUNet
from sdforge.training.trained_model import AdapterUNet, FullUNet
from sdforge.training.unet_init import load_foreign_weights, load_init_unet

log = logging.getLogger(__name__)


def build_trained_model(
    params: Params,
    phase: Phase,
    dist: Dist,
    bucket_shapes: int = 1,
    words: LearnedWords | None = None,
    blockers: tuple[str, ...] = (),
) -> FullUNet:
    """The phase's starting UNet (``init_from``, then ``init_path``, then its adapter if any) on the device, set up
    for training (gradient checkpointing, channels_last, ``train.compile`` for ``bucket_shapes`` shapes), in its
    strategy object; an adapter phase's learned ``words`` (the text encoder's rows) train with it. Sharded over the
    ranks (:class:`ShardedUNet`) where ``train.parallel`` says so (:mod:`sdforge.training.parallel`; ``blockers``:
    what of the phase sharding does not support)."""
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
        _add_unet_adapter(unet, phase.adapter, denoiser_family)
    unet.to(dist.device).train()
    if cfg.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    if cfg.channels_last:
        unet.to(memory_format=torch.channels_last)
    compiled = compile_unet(unet, cfg.compile, bucket_shapes)
    if compiled:
        log.info("train.compile: %s — %d module(s) compiled at their first step", cfg.compile, compiled)
    if sharded:
        bf16 = uses_bf16_autocast(dist.device, cfg.mixed_precision)
        units = shard_model(unet, denoiser_family.shard_blocks, dist.device, bf16)
        log.info("train.parallel: fsdp — %d unit(s) sharded over %d rank(s) (parameters %s, gradients reduced in "
                 "fp32)", units, dist.world, "bf16" if bf16 else "fp32")  # fmt: skip
        return ShardedUNet(unet, dist, units)
    return FullUNet(unet, dist) if phase.adapter is None else AdapterUNet(unet, dist, phase.adapter, words)


def _add_unet_adapter(unet: torch.nn.Module, spec: Adapter, denoiser_family: DenoiserFamily) -> None:
    """Freeze ``unet`` and add the phase's LoRA/DoRA on the family's target groups (:mod:`model.adapters`); log
    trainable vs total weights."""
    pattern = target_pattern(spec.targets, denoiser_family.lora_groups)
    config = lora_config(spec.type, spec.rank, spec.alpha, spec.dropout, pattern)
    add_adapter(unet, config)
    n_train, n_base = count_parameters(unet)
    log.info(
        "%s adapter rank %d on %s: %d trainable weights, %.2f %% of the UNet's %d",
        spec.type, spec.rank, ", ".join(spec.targets), n_train, 100 * n_train / n_base, n_base,
    )  # fmt: skip
