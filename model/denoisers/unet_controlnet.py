"""The UNet family's ControlNet (Zhang et al. 2023): diffusers' ``ControlNetModel`` built from the UNet
(``from_unet``: its encoder and middle block copied, every output convolution zero), and the UNet it steers, as one
module called like the UNet itself.

:class:`ControlledUNet` holds the frozen UNet and the trained ControlNet. The conditioning image is not an argument
of the family's forward call (every loss, the validation loss and the samplers call ``predict(model, x, t, cond)``):
it is set for a block with :meth:`ControlledUNet.conditioned`, so those callers need no change. Pure torch.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch

from model.seeding import seeded

SD_EMBEDDING_CHANNELS = (16, 32, 96, 256)
"""ControlNet's conditioning-image encoder (diffusers' default): 3 stride-2 stages, for SD's 8× VAE."""
CONDITION_CHANNELS = 3
"""An edge map enters as RGB, each channel the map in [0, 1] (what ``StableDiffusionControlNetPipeline`` feeds)."""


def embedding_channels(vae_factor: int, channels: list[int] | None = None) -> tuple[int, ...]:
    """The conditioning encoder's widths for images ``vae_factor``× the latents: ``channels`` if given, else SD's
    first ``log2(vae_factor) + 1`` (each width after the first halves the side); ValueError when they do not fit."""
    steps = round(math.log2(vae_factor))
    if 2**steps != vae_factor:
        raise ValueError(f"the VAE's downsampling {vae_factor} is not a power of 2")
    chosen = tuple(channels) if channels else SD_EMBEDDING_CHANNELS[: steps + 1]
    if len(chosen) != steps + 1:
        raise ValueError(f"the conditioning encoder needs {steps + 1} widths for a {vae_factor}x VAE "
                         f"({steps} stride-2 stages); got {list(chosen)}")  # fmt: skip
    return chosen


def build_unet_controlnet(unet: torch.nn.Module, vae_factor: int, seed: int, channels: list[int] | None = None):
    """A ControlNet copied from ``unet`` (seeded: its conditioning encoder's first layers are drawn), on ``unet``'s
    device and dtype; its zero convolutions make the untrained ControlNet leave the UNet's output unchanged."""
    from diffusers import ControlNetModel  # lazy: diffusers costs 4-6 s to import

    with seeded(seed):
        controlnet = ControlNetModel.from_unet(
            unet, conditioning_embedding_out_channels=embedding_channels(vae_factor, channels),
            conditioning_channels=CONDITION_CHANNELS,
        )  # fmt: skip
    return like(controlnet, unet)


def like(module: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
    """``module`` on ``model``'s device, and in its dtype where that differs (a cast diffusers would warn about)."""
    first = next(model.parameters())
    module = module.to(first.device)
    return module if next(module.parameters()).dtype == first.dtype else module.to(first.dtype)


class ControlledUNet(torch.nn.Module):
    """A frozen UNet steered by a ControlNet: called like the UNet (``forward(x, t, encoder_hidden_states=…)``),
    under the conditioning image :meth:`conditioned` sets. Its ``denoiser_family`` is the UNet's."""

    denoiser_family = "unet"

    def __init__(self, unet: torch.nn.Module, controlnet: torch.nn.Module, scale: float):
        super().__init__()
        self.denoiser, self.controlnet, self.scale = unet, controlnet, scale
        """``denoiser``: the UNet it steers (frozen in training); every controlled family names it so."""
        self.control: torch.Tensor | None = None
        """The conditioning images ``[B, 3, H, W]`` in [0, 1] of the batch in flight (set by :meth:`conditioned`)."""

    @property
    def config(self):
        """The UNet's config (sizes and channels are the UNet's)."""
        return self.denoiser.config

    @property
    def dtype(self) -> torch.dtype:
        return self.denoiser.dtype

    @contextlib.contextmanager
    def conditioned(self, control: torch.Tensor) -> Iterator[None]:
        """Calls within the block run under ``control`` (``[B, 3, H, W]``, or ``[2B, …]`` for a CFG batch)."""
        self.control = control
        try:
            yield
        finally:
            self.control = None

    def forward(self, sample: torch.Tensor, timestep, encoder_hidden_states: torch.Tensor, **kwargs):
        if self.control is None:
            raise RuntimeError("ControlledUNet called without a conditioning image: wrap the call in conditioned()")
        control = self.control
        if control.shape[0] != sample.shape[0]:  # a CFG batch [uncond; cond] under one image per sample
            control = control.repeat(sample.shape[0] // control.shape[0], 1, 1, 1)
        down, mid = self.controlnet(sample, timestep, encoder_hidden_states=encoder_hidden_states,
                                    controlnet_cond=control.to(sample.dtype), conditioning_scale=self.scale,
                                    return_dict=False)  # fmt: skip
        return self.denoiser(sample, timestep, encoder_hidden_states=encoder_hidden_states,
                         down_block_additional_residuals=down, mid_block_additional_residual=mid, **kwargs)  # fmt: skip
