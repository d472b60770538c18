"""Model families behind one denoiser interface (:class:`model.denoisers.base.DenoiserFamily`).

``models.denoiser.family`` names one of :data:`FAMILIES`; code that holds a model asks :func:`family_of`. Adding a
family is one module here and one entry below (docs/ARCHITECTURE.md "The denoiser seam").
"""

from __future__ import annotations

import torch

from model.denoisers.base import CondPart, DenoiserFamily
from model.denoisers.mmdit import MMDiTFamily
from model.denoisers.unet import UNetFamily

FAMILIES: dict[str, DenoiserFamily] = {f.name: f for f in (UNetFamily(), MMDiTFamily())}

__all__ = ["FAMILIES", "CondPart", "DenoiserFamily", "family", "family_for_class", "family_of", "unwrap"]


def family(name: str) -> DenoiserFamily:
    """The family called ``name``; ValueError naming the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown denoiser family {name!r}; known: {sorted(FAMILIES)}") from None


def family_for_class(class_name: str) -> DenoiserFamily:
    """The family of a saved model whose config names ``class_name`` (``_class_name``); ValueError if none."""
    for candidate in FAMILIES.values():
        if candidate.class_name == class_name:
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
    for cls in type(inner).__mro__:
        if any(candidate.class_name == cls.__name__ for candidate in FAMILIES.values()):
            return family_for_class(cls.__name__)
    raise ValueError(f"{type(inner).__name__} is not the model of any denoiser family ({sorted(FAMILIES)})")
