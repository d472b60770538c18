"""A ControlNet phase's trained model (``phases.<p>.controlnet``): a ControlNet on the frozen init UNet. The same
strategy interface as :class:`~sdforge.training.trained_model.FullUNet`: the trained parameters (the ControlNet's),
what a checkpoint holds (``controlnet/``, a diffusers folder) and what the phase exports (``controlnet/`` and
``controlnet_ema/`` beside the unchanged base UNet in ``unet/`` and ``unet_ema/``). docs/CONTROL.md."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.denoisers import DenoiserFamily
from sdforge.config import ControlNet
from sdforge.training.checkpoints import CheckpointError
from sdforge.training.distributed import Dist
from sdforge.training.trained_model import FullUNet, first_line

log = logging.getLogger(__name__)

CONTROLNET_DIR = "controlnet"
"""A checkpoint's and an export's ControlNet folder (diffusers format); the EMA's: ``controlnet_ema``."""
CONTROLNET_FILE = "diffusion_pytorch_model.safetensors"


def attach_controlnet(unet: torch.nn.Module, spec: ControlNet, family: DenoiserFamily, vae_factor: int, seed: int):
    """Freeze ``unet`` and put it under a new ControlNet copied from it (the family's, seeded by ``seed``)."""
    unet.requires_grad_(False)
    controlled = family.controlled(unet, vae_factor, seed, spec.conditioning_scale, spec.embedding_channels)
    trained = sum(p.numel() for p in controlled.controlnet.parameters())
    base = sum(p.numel() for p in unet.parameters())
    log.info("controlnet (%s, scale %g): %d trainable weights on the frozen UNet's %d", spec.condition,
             spec.conditioning_scale, trained, base)  # fmt: skip
    return controlled


class ControlNetUNet(FullUNet):
    """Only the ControlNet trains; the UNet it steers is the init's, frozen. ``unet`` is the controlled whole
    (called like the UNet, under :meth:`controlled`'s image)."""

    def __init__(self, controlled: torch.nn.Module, dist: Dist, spec: ControlNet):
        self.spec = spec
        self.controlnet = controlled.controlnet
        super().__init__(controlled, dist)

    def controlled(self, image: torch.Tensor | None):
        """The micro-batch's forward runs under conditioning ``image`` (``[B, 3, H, W]``)."""
        if image is None:
            raise RuntimeError("a ControlNet phase's micro-batch has no conditioning image")
        return self.unet.conditioned(image)

    def parameter_counts(self) -> dict:
        """``trainable_params`` (the ControlNet's), ``unet_params`` (the frozen UNet's), their ratio."""
        trainable = sum(p.numel() for p in self.controlnet.parameters())
        base = sum(p.numel() for p in self.unet.denoiser.parameters())
        return {"trainable_params": trainable, "unet_params": base, "trainable_share": round(trainable / base, 6)}

    def live_tensors(self) -> dict[str, torch.Tensor]:
        return self.controlnet.state_dict()

    def write_live(self, ckpt: Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """``controlnet/``: the ControlNet's config and weights (``tensors``, default :meth:`live_tensors`)."""
        folder = ckpt / CONTROLNET_DIR
        folder.mkdir(parents=True)
        self.controlnet.save_config(folder)
        tensors = self.live_tensors() if tensors is None else tensors
        save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, folder / CONTROLNET_FILE,
                  metadata={"format": "pt"})  # fmt: skip

    def load_live(self, ckpt: Path) -> None:
        path = ckpt / CONTROLNET_DIR / CONTROLNET_FILE
        try:
            saved = load_file(path)
            self.controlnet.load_state_dict(saved)
        except Exception as err:
            raise CheckpointError(f"{path}: not this phase's ControlNet ({first_line(err)})") from err

    def export(self, out_dir: Path, unet_dir: str, adapter_dir: str) -> None:
        """``out_dir/unet_dir``: the frozen UNet as it came; ``controlnet`` (``controlnet_ema`` beside
        ``unet_ema``): the ControlNet's current weights."""
        self.unet.denoiser.save_pretrained(out_dir / unet_dir, safe_serialization=True)
        self.controlnet.save_pretrained(out_dir / unet_dir.replace("unet", CONTROLNET_DIR), safe_serialization=True)

    def describe(self) -> dict:
        return {"controlnet": self.spec.model_dump()}

