"""Where a phase's denoiser starts: a previous phase's checkpoint, optionally overwritten by a foreign state dict.

Either way the architecture must be the one ``params.yaml`` describes (``models.<family>``); a mismatch is
an :class:`~sdforge.io.InputError` naming the key. The checkpoint folders keep their first family's names
(``unet/``, ``unet_ema/``) whatever the family: they hold the denoiser in diffusers format.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file

from model.denoisers import DenoiserFamily
from model.weights import load_state_dict_strict, strip_wrapper_prefixes, unnest_state_dict
from sdforge.eval.sampling import saved_family
from sdforge.io import InputError, load_failure

log = logging.getLogger(__name__)

def load_init_unet(init_dir: Path, weights: str, spec: dict, family: DenoiserFamily | None = None):
    """The phase's starting denoiser of ``family`` (None: the family its folder's config names); the family's
    architecture keys must equal ``spec``'s (``models.<family>``), else a clear error."""
    sub = "unet_ema" if weights == "ema" else "unet"
    path = init_dir / sub
    if not (path / "config.json").is_file():
        raise InputError(f"{path}: no UNet checkpoint to start from (run the previous phase or prepare_models)")
    family = saved_family(path) if family is None else family
    try:
        unet = family.model_class().from_pretrained(path, use_safetensors=True)
    except Exception as err:  # a damaged or pickle-only folder: the file's fault, named in one line
        raise InputError(
            f"{path}: cannot load the UNet ({load_failure(err, with_type=True)}); re-run the stage that wrote it"
        ) from None
    for key in family.architecture_keys():
        want, got = spec.get(key), unet.config.get(key)
        if _norm(want) != _norm(got):
            raise InputError(f"{path}: checkpoint has {key}={got!r} but params models.{family.spec_key}.{key}={want!r}")
    return unet


def _norm(v):
    return list(v) if isinstance(v, list | tuple) else v


def load_foreign_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or ``.pt``/``.pth``/``.bin`` (``weights_only``), unnested and unprefixed."""
    if not path.is_file():
        raise InputError(f"phase init_path {path}: no such file")
    try:
        if path.suffix == ".safetensors":
            obj = load_file(path)
        elif path.suffix in (".pt", ".pth", ".bin", ".ckpt"):
            obj = torch.load(path, map_location="cpu", weights_only=True)
        else:
            raise InputError(f"phase init_path {path}: expected .safetensors, .pt, .pth, .bin or .ckpt")
        return strip_wrapper_prefixes(unnest_state_dict(obj))
    except InputError:
        raise
    except Exception as err:  # unpicklable, truncated, not a dict: all the file's fault
        raise InputError(
            f"phase init_path {path}: cannot read a state dict ({load_failure(err, with_type=True)}); "
            "convert it to .safetensors on a machine you trust"
        ) from None


def load_foreign_weights(unet: torch.nn.Module, path: Path) -> None:
    """Load the foreign state dict at ``path`` strictly into ``unet``; a mismatch is an InputError naming keys."""
    state_dict = load_foreign_state_dict(path)
    try:
        load_state_dict_strict(unet, state_dict)
    except ValueError as err:
        raise InputError(f"phase init_path {path}: {err} (params models.unet must describe this checkpoint)") from err
    log.info("initialised the UNet from %s (%d tensors)", path, len(state_dict))
