"""Seeded random VAE / CLIP text encoder with the real architecture of a hub id (``configs/*.json``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from diffusers import AutoencoderKL
from transformers import CLIPTextConfig, CLIPTextModel

from model.builders import count_parameters, seeded
from sdforge.config import ConfigError

log = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parent / "configs"
VAE_CLASS = "AutoencoderKL"
TEXT_MODEL_TYPE = "clip_text_model"


def _kind(config: dict[str, Any]) -> str:
    """``vae`` or ``text_encoder``, from the config's own class marker."""
    if config.get("_class_name") == VAE_CLASS:
        return "vae"
    if config.get("model_type") == TEXT_MODEL_TYPE:
        return "text_encoder"
    raise ValueError(f"neither an {VAE_CLASS} nor a {TEXT_MODEL_TYPE} config: {sorted(config)}")


def _configs() -> dict[str, dict[str, Any]]:
    """Every config here by hub id (``owner--name.json`` → ``owner/name``)."""
    return {p.stem.replace("--", "/", 1): json.loads(p.read_text()) for p in sorted(CONFIGS.glob("*.json"))}


def known_architectures(kind: str | None = None) -> list[str]:
    """Hub ids with a config here, sorted; only those of ``kind`` (``vae``/``text_encoder``) if given."""
    return [hub_id for hub_id, config in _configs().items() if kind is None or _kind(config) == kind]


def architecture_config(hub_id: str, kind: str) -> dict[str, Any]:
    """The stored config of ``hub_id``; :class:`ConfigError` naming ``models.<kind>`` if there is none."""
    config = _configs().get(hub_id)
    if config is None or _kind(config) != kind:
        raise ConfigError(
            f"models.{kind}: no architecture stored for {hub_id!r} in sdforge/architectures/configs, so it "
            f"cannot be built with random weights (models.missing_weights: random); known {kind} ids: "
            f"{known_architectures(kind)}. Add its config there, or make the weights available locally."
        )
    return config


def build_random_vae(hub_id: str, seed: int) -> AutoencoderKL:
    """``hub_id``'s ``AutoencoderKL`` with seeded random weights, in eval mode with gradients off."""
    config = architecture_config(hub_id, "vae")
    with seeded(seed):
        vae = AutoencoderKL.from_config(config)
    vae.eval().requires_grad_(False)
    log.info("built %s's VAE architecture with random weights (seed %d): %d parameters",
             hub_id, seed, count_parameters(vae))
    return vae


def build_random_text_encoder(hub_id: str, seed: int, encoder_class: type = CLIPTextModel) -> CLIPTextModel:
    """``hub_id``'s text encoder (``encoder_class``: ``CLIPTextModel`` or ``…WithProjection``) with seeded random
    weights, in eval mode with gradients off."""
    config = architecture_config(hub_id, "text_encoder")
    with seeded(seed):
        model = encoder_class(CLIPTextConfig.from_dict(config))
    model.eval().requires_grad_(False)
    log.info("built %s's text encoder architecture with random weights (seed %d): %d parameters",
             hub_id, seed, count_parameters(model))
    return model
