"""Model families behind one denoiser interface (:class:`model.denoisers.base.DenoiserFamily`).

``models.denoiser.family`` names one of :data:`FAMILIES`; code that holds a model asks :func:`family_of`. Adding a
family is one module here and one entry below (docs/ARCHITECTURE.md "The denoiser seam").
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from model.denoisers.base import CondPart, DenoiserFamily, uncropped_sizes
from model.denoisers.mmdit import MMDiTFamily
from model.denoisers.sdxl import SDXLFamily
from model.denoisers.unet import UNetFamily

FAMILIES: dict[str, DenoiserFamily] = {f.name: f for f in (UNetFamily(), MMDiTFamily(), SDXLFamily())}

__all__ = ["FAMILIES", "CondPart", "DenoiserFamily", "family", "family_for_config", "family_of", "uncropped_sizes",
           "unwrap"]  # fmt: skip


def family(name: str) -> DenoiserFamily:
    """The family called ``name``; ValueError naming the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown denoiser family {name!r}; known: {sorted(FAMILIES)}") from None


def family_for_config(class_name: str, config: Mapping) -> DenoiserFamily:
    """The family of a model of diffusers class ``class_name`` (a saved config's ``_class_name``) with ``config``
    (the unet and sdxl families share a class: SDXL's has ``addition_embed_type: text_time``); ValueError if none."""
    for candidate in FAMILIES.values():
        if candidate.owns(class_name, config):
            return candidate
    raise ValueError(f"{class_name!r} is not the model of any denoiser family ({sorted(FAMILIES)})")


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def family_of(model: torch.nn.Module) -> DenoiserFamily:
    """The family whose model class ``model`` (or the model a wrapper holds) is, or that its ``denoiser_family``
    attribute names (a stand-in module called like that family's model, as tests use); ValueError if none."""
    inner = unwrap(model)
    named = getattr(inner, "denoiser_family", None)
    if isinstance(named, str):
        return family(named)
    config = getattr(inner, "config", {})
    for cls in type(inner).__mro__:
        if any(candidate.owns(cls.__name__, config) for candidate in FAMILIES.values()):
            return family_for_config(cls.__name__, config)
    raise ValueError(f"{type(inner).__name__} is not the model of any denoiser family ({sorted(FAMILIES)})")
