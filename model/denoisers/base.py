"""The denoiser seam: what every stage needs of a model family, in one small interface.

A family (:mod:`model.denoisers.unet`, :mod:`model.denoisers.mmdit`, :mod:`model.denoisers.sdxl`) says how its
denoiser is built from a spec, which text conditioning it takes and how it is called, its image-size rules, its
FLOPs, its LoRA target groups in words, and the diffusers pipeline an export writes. Training, eval, export,
preflight and the benches call these methods and never name a model class: ``tests/test_architecture.py`` holds
that no module outside this package names ``UNet2DConditionModel`` or ``SD3Transformer2DModel``.

**The conditioning tensor.** Whatever text conditioning a family takes travels as one tensor ``[B, L, D]`` whose
layout only the family reads (:meth:`DenoiserFamily.predict` unpacks it). The UNet's is CLIP's last hidden state;
the MM-DiT's packs its two encoders' sequences side by side and the pooled vector as one extra row; SDXL's adds
one more row for each image's size and crop (:meth:`DenoiserFamily.sized`). So CFG dropout,
the empty prompt's embedding, classifier-free guidance's ``[uncond; cond]`` batch, validation and distillation
handle every family alike; per-encoder caption dropout replaces the regions :meth:`DenoiserFamily.cond_parts`
names.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CondPart:
    """A region of the conditioning tensor that caption dropout can replace on its own: ``rows`` × ``cols``."""

    name: str
    rows: slice
    cols: slice


class DenoiserFamily(ABC):
    """One model family behind the seam (the registry in :mod:`model.denoisers` holds one instance each)."""

    name: str
    """``models.denoiser.family``."""
    class_name: str
    """The diffusers model class's name, as a saved folder's ``config.json`` records it (``_class_name``)."""
    spec_key: str
    """The ``models.<key>`` section holding this family's architecture (``unet``, ``mmdit``)."""
    text_encoder_classes: tuple[str, ...]
    """The transformers class of each text encoder, in order (``CLIPTextModel``, ``CLIPTextModelWithProjection``)."""
    text_encoders: int
    """How many text encoders (and tokenizers) condition it: ``text_encoder``, ``text_encoder_2``, …"""
    lora_groups: dict[str, tuple[str, ...]]
    """Adapter target groups in words → module-name suffixes (regexes) that peft matches."""
    objectives: tuple[str, ...]
    """The training objectives it supports (``train.objective``)."""
    shard_blocks: tuple[str, ...]
    """The module classes ``train.parallel: fsdp`` shards one by one (then the root): each is a unit of all-gather
    and reduce-scatter (:mod:`model.sharding`)."""
    flow_euler: bool
    """Flow matching samples with diffusers' ``FlowMatchEulerDiscreteScheduler`` (its pipeline runs it); else with
    the flow-sigma DPM-Solver that ``StableDiffusionPipeline`` can run (:func:`model.sampler.flow_euler_scheduler`)."""

    micro_conditioning: bool = False
    """It takes each image's size and crop (SDXL's ``time_ids``): the trainer reads them per sample from the latent
    manifest and the sampler makes them from the image size; :meth:`sized` writes them into the conditioning."""

    # ------------------------------------------------------------------------------------------ the model
    def owns(self, class_name: str, config: Mapping) -> bool:
        """Whether a saved or built model of diffusers class ``class_name`` with ``config`` is this family's."""
        return class_name == self.class_name

    @abstractmethod
    def model_class(self) -> type:
        """The diffusers model class (``from_pretrained``/``save_pretrained``)."""

    @abstractmethod
    def config(self, spec: dict) -> dict:
        """The diffusers config for a ``models.<spec_key>`` dict; ValueError naming a bad key."""

    @abstractmethod
    def build(self, config: dict, seed: int) -> torch.nn.Module:
        """A from-scratch model (seeded: same seed, same weights), its output layers zeroed where the family
        starts so. Works under ``with torch.device("meta"):``."""

    @abstractmethod
    def architecture_keys(self) -> tuple[str, ...]:
        """Config keys a checkpoint must share with params to be loaded as this run's denoiser."""

    @abstractmethod
    def predict(self, model: torch.nn.Module, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """The model's output for latents ``x`` ``[B, C, h, w]`` at timesteps ``t`` (``[B]`` or a scalar, in
        ``[0, num_train_timesteps)``) under the packed conditioning ``cond``. ``model`` may be a DDP wrapper."""

    # ------------------------------------------------------------------------------------------ the text
    @abstractmethod
    def encode_text(self, encoders: list, ids: list[torch.Tensor]) -> torch.Tensor:
        """The packed conditioning ``[B, L, D]`` from each encoder's token ids ``[B, L]``."""

    def cond_parts(self, widths: list[int], pooled_widths: list[int], tokens: int) -> list[CondPart]:
        """The regions caption dropout may drop one by one (none: only the whole prompt), for ``tokens`` text
        tokens."""
        return []

    @abstractmethod
    def check_text_widths(self, config: dict, widths: list[int], pooled_widths: list[int]) -> None:
        """ValueError starting with the spec key when the text encoders' hidden (``widths``) and projected pooled
        widths do not fit the denoiser ``config``."""

    # ------------------------------------------------------------------------------------------ sizes
    def sized(self, cond: torch.Tensor, sizes: torch.Tensor | None) -> torch.Tensor:
        """``cond`` with each image's micro-conditioning ``sizes`` ``[B|1, 6]`` (original h, w, crop top, left,
        target h, w in px) written in; ``cond`` itself for a family without :attr:`micro_conditioning`."""
        return cond

    @abstractmethod
    def latent_channels(self, model: torch.nn.Module) -> int:
        """Channels of the latents it denoises."""

    @abstractmethod
    def trained_side(self, model: torch.nn.Module, vae_factor: int) -> int:
        """The image side in px it was built for (its sample size × the VAE's downsampling)."""

    @abstractmethod
    def pixel_multiple(self, model: torch.nn.Module, vae_factor: int) -> int:
        """The multiple an image side must be (VAE factor × the model's own downsampling or patch)."""

    @abstractmethod
    def cond_shape(self, config: dict, tokens: int) -> tuple[int, int]:
        """``(rows, width)`` of the packed conditioning for ``tokens`` text tokens (a bench's random stand-in)."""

    def flops_per_sample(self, config: dict, latent_side: int, text_rows: int, text_width: int) -> float:
        """Forward + backward FLOPs of one training sample at ``latent_side``² latents (batch 1, on ``meta``)."""
        from torch.utils.flop_counter import FlopCounterMode  # lazy: only MFU reports count FLOPs

        with torch.device("meta"):
            model = self.build(config, seed=0)
            x = torch.randn(1, self.latent_channels(model), latent_side, latent_side)
            cond = torch.randn(1, text_rows, text_width)
            with FlopCounterMode(display=False) as counter:
                self.predict(model, x, torch.tensor([500.0]), cond).float().pow(2).mean().backward()
        return float(counter.get_total_flops())

    # ------------------------------------------------------------------------------------------ control
    def controlled(self, denoiser: torch.nn.Module, vae_factor: int, seed: int, scale: float,
                   channels: list[int] | None = None) -> torch.nn.Module:  # fmt: skip
        """``denoiser`` under a new ControlNet copied from it (seeded), as one module called like the denoiser: its
        ``conditioned(image)`` sets the conditioning image, ``controlnet`` is the trained part and ``denoiser`` the
        steered one; a ValueError naming the family where it has none."""
        raise ValueError(f"the {self.name} family has no ControlNet in this version")

    def load_controlled(self, denoiser: torch.nn.Module, folder, scale: float) -> torch.nn.Module:
        """:meth:`controlled` with the ControlNet read from a saved diffusers folder."""
        raise ValueError(f"the {self.name} family has no ControlNet in this version")

    # ------------------------------------------------------------------------------------------ export
    lora_prefix: str
    """The key prefix of the denoiser's layers in a diffusers LoRA file (``load_lora_weights`` reads it)."""
    pipeline_call: dict = {}
    """Arguments a call of the exported pipeline needs beyond the prompt to draw what ``generate`` draws."""
    pipeline_load: dict = {}
    """Arguments its ``from_pretrained`` needs (components the export leaves out on purpose)."""
    controlnet_pipeline: str | None = None
    """The diffusers pipeline class that samples the family's denoiser under its ControlNet (None: it has none)."""

    @abstractmethod
    def save_lora(self, folder, layers: dict, metadata: dict, text: dict[str, tuple[dict, dict]] | None = None) -> None:
        """Write ``layers`` (peft's state dict of the denoiser's adapter) as ``folder/pytorch_lora_weights.safetensors``
        in the format the family's pipeline's ``load_lora_weights`` reads, with the peft config as metadata; ``text``:
        each adapted text encoder's (by folder name: ``text_encoder``, ``text_encoder_2``) layers and config, in the
        same file."""

    @abstractmethod
    def pipeline(self, denoiser, vae, encoders: list, tokenizers: list, scheduler):
        """The diffusers pipeline an export writes, from its parts (``from_pretrained`` of the folder draws what
        ``sdforge generate`` draws)."""


def uncropped_sizes(height: int, width: int) -> torch.Tensor:
    """``[1, 6]`` micro-conditioning of an uncropped ``height × width`` image drawn at its own size (what diffusers'
    SDXL pipeline uses by default): original = target = ``(height, width)``, crop ``(0, 0)``."""
    return torch.tensor([[height, width, 0, 0, height, width]], dtype=torch.float32)


def text_lora_kwargs(text: dict[str, tuple[dict, dict]] | None) -> dict:
    """The text encoders' part of a diffusers ``save_lora_weights`` call: ``<name>_lora_layers`` and
    ``<name>_lora_adapter_metadata`` per adapted encoder (the same names in every pipeline's loader)."""
    kwargs: dict = {}
    for name, (layers, metadata) in (text or {}).items():
        kwargs[f"{name}_lora_layers"], kwargs[f"{name}_lora_adapter_metadata"] = layers, metadata
    return kwargs
