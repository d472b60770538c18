"""The phase's optimizer (``phases.<p>.optimizer``): AdamW, 8-bit AdamW (bitsandbytes) or Prodigy (prodigyopt).

All three take ``train``'s betas, eps and weight decay, and the phase's ``lr``. Prodigy estimates the step
size itself (D-adaptation, Mishchenko & Defazio 2023): there ``lr`` multiplies its estimate, so 1.0 is the
usual value. bitsandbytes is not a dependency of the project (installed, diffusers imports it in every stage
process: ~2.5 s each); a phase that asks for ``adamw8bit`` without it fails before training starts, naming
the key and the install command.
"""

from __future__ import annotations

import importlib
import logging

import torch

from sdforge.config import Train
from sdforge.io import InputError

log = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "adamw8bit", "prodigy")


def build_optimizer(
    name: str, parameters, lr: float, cfg: Train, device: torch.device, where: str, capturable: bool = False
):
    """The optimizer ``name`` over ``parameters`` (a list); ``where`` (``phases.<p>.optimizer``) names the key in
    errors. ``capturable``: its step can be captured in a CUDA graph (AdamW only: the caller refuses the others)."""
    kwargs = dict(lr=lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    if name == "adamw":
        return _adamw(parameters, device, kwargs | ({"capturable": True} if capturable else {}))
    if name == "adamw8bit":
        bnb = _optional_module("bitsandbytes", where, "pip install bitsandbytes")
        return bnb.optim.AdamW8bit(parameters, **kwargs)
    if name == "prodigy":
        prodigyopt = _optional_module("prodigyopt", where, "pip install prodigyopt")
        return prodigyopt.Prodigy(parameters, **kwargs)
    raise InputError(f"{where}: unknown optimizer {name!r}; one of {', '.join(OPTIMIZERS)}")


def _adamw(parameters, device: torch.device, kwargs: dict) -> torch.optim.AdamW:
    """torch's AdamW, fused on CUDA (falls back to the default implementation where fused is unavailable)."""
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(parameters, fused=True, **kwargs)
        except (RuntimeError, TypeError) as err:
            log.warning("fused AdamW unavailable (%s); using the default implementation", err)
    return torch.optim.AdamW(parameters, **kwargs)


def _optional_module(module: str, where: str, install: str):
    """``import module`` (lazily: optional, and heavy for bitsandbytes), or an InputError saying how to get it."""
    try:
        return importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - missing, or installed without a backend for this machine
        raise InputError(
            f"{where}: needs the package '{module}' ({type(err).__name__}: {err}); `{install}` "
            "(bitsandbytes needs a build with a backend for this device), or choose adamw"
        ) from None
