"""An adapter phase's weight folders: the LoRA file diffusers' ``load_lora_weights`` reads, and plain UNets.

``adapter/`` and ``adapter_ema/`` hold ``pytorch_lora_weights.safetensors`` in diffusers' format (keys
``unet.<module>.lora_A/B.weight`` — ``transformer.`` for the mmdit family —, and ``lora_magnitude_vector`` for
DoRA), with the peft config (rank, alpha, DoRA) in its metadata, so the pipeline's ``load_lora_weights(folder)`` on
the phase's base rebuilds the same adapter. A phase that learns words (``adapter.words``) adds
``learned_embeds.safetensors`` (word → input-embedding row) to both. ``unet/`` and ``unet_ema/`` are ordinary
diffusers denoiser folders: the base with the adapter merged, or the base alone (``adapter.merge: false``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

from model.adapters import merged, plain_state_dict
from model.denoisers import family_of
from model.learned_words import learned_words_file
from model.quantization import dequantised_state, is_quantised
from sdforge.eval.sampling import LORA_FILE
from sdforge.io import atomic_write_bytes
from sdforge.latents.store import sorted_header

log = logging.getLogger(__name__)

UNET_FILE = "diffusion_pytorch_model.safetensors"


def write_lora_folder(unet: torch.nn.Module, folder: Path, text_lora: dict[str, torch.nn.Module] | None = None) -> Path:
    """``unet``'s current adapter weights as ``folder/pytorch_lora_weights.safetensors`` (diffusers' format), with
    the LoRA of each text encoder in ``text_lora`` (by folder name) under its prefix (``text_encoder.``, …).

    The keys stay peft's (``lora_A``/``lora_B``): diffusers' ``convert_state_dict_to_diffusers`` renames only the
    attention projections (``to_q.lora_A`` → ``to_q.lora.down``), and ``load_lora_adapter`` converts back only when
    the file's first key is of that kind — a LoRA on attention and other layers (``time_embedding``, ``proj``, …)
    then loaded without its attention weights (diffusers 0.42; tests/sdforge/training/test_adapter_files.py)."""
    layers = get_peft_model_state_dict(unet)
    metadata = unet.peft_config["default"].to_dict()
    text = {name: (get_peft_model_state_dict(encoder), encoder.peft_config["default"].to_dict())
            for name, encoder in (text_lora or {}).items()}  # fmt: skip
    family_of(unet).save_lora(folder, layers, metadata, text)
    path = folder / LORA_FILE  # its metadata map comes in hash order: same weights, other bytes each process
    atomic_write_bytes(path, sorted_header(path.read_bytes()))
    return path


def write_learned_words(vectors: dict[str, torch.Tensor], folder: Path, encoder_index: int = 0) -> Path:
    """``folder/learned_embeds.safetensors`` (``learned_embeds_2`` for the second text encoder, …): word → its
    learned input-embedding row (fp32)."""
    path = folder / learned_words_file(encoder_index)
    save_file({w: v.contiguous() for w, v in vectors.items()}, path, metadata={"format": "pt"})
    return path


def write_plain_unet(unet: torch.nn.Module, folder: Path, merge: bool) -> None:
    """``unet`` (carrying an adapter) as a plain diffusers UNet folder: adapter merged in, or the base alone.

    No second copy of the model is made: the merge is in place and undone exactly afterwards
    (:func:`model.adapters.merged`), and the tensors are written straight from the live modules.
    """
    folder.mkdir(parents=True)
    unet.save_config(folder)
    if any(is_quantised(t) for t in unet.state_dict().values()):  # QLoRA: peft cannot merge into a quantised weight
        _write_state(dequantised_merge(unet) if merge else dequantised_state(plain_state_dict(unet)),
                     folder / UNET_FILE)  # fmt: skip
    elif merge:
        with merged(unet):
            _write_state(plain_state_dict(unet), folder / UNET_FILE)
    else:
        _write_state(plain_state_dict(unet), folder / UNET_FILE)


@torch.no_grad()
def dequantised_merge(unet: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain state dict of a UNet whose base is quantised (``adapter.base_precision``) with its adapter merged:
    each adapted layer's dequantised weight plus the adapter's delta, in fp32 (the base's precision as loaded)."""
    state = dequantised_state(plain_state_dict(unet))
    for name, layer in unet.named_modules():
        if isinstance(layer, BaseTunerLayer):
            key = f"{name}.weight"
            state[key] = state[key].float() + layer.get_delta_weight("default").float()
    return state


def _write_state(state: dict[str, torch.Tensor], path: Path) -> None:
    save_file({k: v.detach().contiguous() for k, v in state.items()}, path, metadata={"format": "pt"})
