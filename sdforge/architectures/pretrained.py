"""The frozen models of a full-scale run: the VAE and the family's CLIP text encoders + tokenizers from the hub (or
local folders) via ``from_pretrained``; with ``models.missing_weights: random`` (the preflight), seeded random
stand-ins with the real architecture for those not on this machine (:mod:`sdforge.architectures.frozen`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers
from diffusers import AutoencoderKL
from transformers import CLIPTokenizer

from model.denoisers import DenoiserFamily
from model.text_stack import text_part_dirs
from sdforge.architectures.clip_tokenizer import write_clip_tokenizer
from sdforge.architectures.frozen import build_random_text_encoder, build_random_vae
from sdforge.config import ConfigError, Models

log = logging.getLogger(__name__)

MIN_BPE_TOKENS = 256
"""A byte-level BPE vocabulary holds at least the 256 byte characters; fewer: no tokenizer files were found."""


def check_text_widths(denoiser_family: DenoiserFamily, config: dict, encoders: list) -> None:
    """The denoiser reads the text encoders' widths: a ConfigError naming ``models.<family>``'s key if not."""
    widths = [int(e.config.hidden_size) for e in encoders]
    pooled = [int(getattr(e.config, "projection_dim", e.config.hidden_size)) for e in encoders]
    try:
        denoiser_family.check_text_widths(config, widths, pooled)
    except ValueError as err:
        raise ConfigError(f"models.{denoiser_family.spec_key}.{err}") from None


def _from_pretrained(load: Callable[..., Any], key: str, name: str, local_only: bool) -> Any | None:
    """``load(name)``. ``local_only`` (``missing_weights: random``): local files only, and None with a WARNING
    when no local folder or cache holds them; otherwise a :class:`ConfigError` naming ``models.<key>``."""
    try:
        loaded = load(name, local_files_only=True) if local_only else load(name)
        if isinstance(loaded, CLIPTokenizer) and len(loaded) < MIN_BPE_TOKENS:  # transformers 5 does not raise
            raise OSError(f"no tokenizer files (from_pretrained gave a {len(loaded)}-token placeholder)")
        return loaded
    except (OSError, ValueError) as err:
        if not local_only:
            raise ConfigError(f"models.{key}: cannot load {name!r} with from_pretrained: {err} "
                              "(models.missing_weights: random builds a random stand-in, for preflight only)") from err
        log.warning("models.%s: %r is not on this machine (%s); models.missing_weights: random builds its "
                    "architecture with random weights: fine for a preflight, never for a real run", key, name, err)
        return None


def load_pretrained_text(
    models: Models, denoiser_family: DenoiserFamily, out: Path, metrics: dict[str, Any]
) -> tuple[list[CLIPTokenizer], list]:
    """Full scale: the family's CLIP text encoders and tokenizers (``models.text_encoder``, ``text_encoder_2``) via
    ``from_pretrained``; with ``missing_weights: random``, seeded random stand-ins for those not on this machine."""
    local_only = models.missing_weights == "random"
    tokenizers, encoders = [], []
    for i, (encoder_dir, tokenizer_dir) in enumerate(text_part_dirs(denoiser_family)):
        encoder_class = getattr(transformers, denoiser_family.text_encoder_classes[i])
        hub_id = getattr(models, encoder_dir)
        encoder = _from_pretrained(encoder_class.from_pretrained, encoder_dir, hub_id, local_only)
        metrics[f"{encoder_dir}_weights"] = "random" if encoder is None else "pretrained"
        if encoder is None:
            encoder = build_random_text_encoder(hub_id, models.seed + i, encoder_class)
        tokenizer = _from_pretrained(CLIPTokenizer.from_pretrained, encoder_dir, hub_id, local_only)
        if tokenizer is None:
            tokenizer = write_clip_tokenizer(out / tokenizer_dir, encoder.config.max_position_embeddings)
        else:
            tokenizer.save_pretrained(out / tokenizer_dir)
        tokenizers.append(tokenizer)
        encoders.append(encoder)
    return tokenizers, encoders


def load_pretrained_vae(models: Models, metrics: dict[str, Any]) -> AutoencoderKL:
    """The hub (or local) VAE; with ``missing_weights: random``, a seeded stand-in when it is not on this machine."""
    vae = _from_pretrained(AutoencoderKL.from_pretrained, "vae", models.vae, models.missing_weights == "random")
    metrics["vae_weights"] = "random" if vae is None else "pretrained"
    return build_random_vae(models.vae, models.seed) if vae is None else vae
