"""The text encoders' LoRA of an adapter phase (``adapter.text_encoders``) on load: applied from the phase's LoRA
file the way ``load_lora_weights`` applies it, fused for an export, or dropped again (the base encoders an export
writes beside the LoRA file)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from sdforge.io import InputError, load_failure

log = logging.getLogger(__name__)


def load_text_lora(encoders: dict[str, torch.nn.Module], folder: Path, weight_name: str) -> list[str]:
    """Apply the text-encoder layers of ``folder/weight_name`` to ``encoders`` (by folder name: ``text_encoder``,
    ``text_encoder_2``) with diffusers' own loader, unfused; the names it applied to (none: the file has none). An
    InputError naming the folder when they do not fit."""
    # lazy: diffusers costs 4-6 s to import; the loader is the one StableDiffusionXLPipeline.load_lora_weights uses
    from diffusers.loaders import StableDiffusionXLLoraLoaderMixin as Loader

    state, alphas, metadata = Loader.lora_state_dict(str(folder), weight_name=weight_name, return_lora_metadata=True)
    applied = [name for name in encoders if any(k.startswith(f"{name}.") for k in state)]
    try:
        for name in applied:
            Loader.load_lora_into_text_encoder(state, alphas, encoders[name], prefix=name, metadata=metadata)
    except Exception as err:  # noqa: BLE001 - a file that does not apply is the folder's fault: one line
        raise InputError(f"{folder}: the text encoders' LoRA does not apply ({load_failure(err, with_type=True)})"
                         ) from None  # fmt: skip
    if applied:
        log.info("%s: LoRA applied to %s", folder, ", ".join(applied))
    return applied


def fuse_text_lora(encoder: torch.nn.Module) -> None:
    """Fuse the LoRA applied to ``encoder`` into its weights and drop its LoRA layers (a plain encoder again)."""
    from diffusers.loaders.lora_base import fuse_text_encoder_lora  # lazy: diffusers costs 4-6 s to import

    fuse_text_encoder_lora(encoder)
    unload_text_lora(encoder)


def unload_text_lora(encoder: torch.nn.Module) -> None:
    """Drop the LoRA layers of ``encoder``: the base layers stay (fused or not), as ``unload_lora_weights`` does."""
    from diffusers.utils.peft_utils import recurse_remove_peft_layers  # lazy: diffusers costs 4-6 s to import

    recurse_remove_peft_layers(encoder)
    if getattr(encoder, "peft_config", None) is not None:
        del encoder.peft_config
        encoder._hf_peft_config_loaded = None
