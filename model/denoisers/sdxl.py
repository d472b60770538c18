"""The SDXL family: diffusers' ``UNet2DConditionModel`` with ``addition_embed_type: text_time`` under two CLIP text
encoders (CLIP ViT-L without projection, OpenCLIP ViT-bigG with projection). Sampled by
``StableDiffusionXLPipeline``.

**Conditioning, as SDXL builds it** (``StableDiffusionXLPipeline.encode_prompt``): each CLIP's penultimate hidden
state ``[B, L, D_i]`` side by side ``[B, L, D_1 + D_2]`` (= ``cross_attention_dim``); the pooled vector is the
second encoder's projected pooled output ``[B, P]``; and six numbers per image, SDXL's micro-conditioning
``time_ids``: original height and width, crop top and left, target height and width, in pixels. The packed tensor
this project passes around (:mod:`model.denoisers.base`) is the sequence, one row holding the pooled vector, and a
last row holding the six numbers: ``[B, L + 2, max(D_1 + D_2, P, 6)]``; :meth:`SDXLFamily.predict` unpacks it.

The text rows come from :meth:`SDXLFamily.encode_text` with the time-ids row at zero; :meth:`SDXLFamily.sized`
writes each sample's numbers after CFG dropout (a dropped prompt keeps its image's sizes, as diffusers' SDXL
training script does): the trainer reads them from the latent manifest (:mod:`sdforge.latents.sizes`), the sampler
uses ``(h, w, 0, 0, h, w)`` for an ``h × w`` image, what the pipeline's defaults give.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from model.denoisers.base import CondPart, DenoiserFamily, text_lora_kwargs
from model.denoisers.unet import UNET_GROUPS, UNetFamily

SPEC_KEYS = ("sample_size", "in_channels", "out_channels", "block_out_channels", "layers_per_block",
             "down_block_types", "up_block_types", "cross_attention_dim", "attention_head_dim",
             "transformer_layers_per_block", "norm_num_groups", "use_linear_projection", "addition_time_embed_dim",
             "projection_class_embeddings_input_dim")  # fmt: skip
"""The ``UNet2DConditionModel`` config keys a ``models.sdxl`` spec sets; ``addition_embed_type`` is ``text_time``."""
TIME_IDS = 6
"""SDXL's micro-conditioning numbers per image: original (h, w), crop top-left (top, left), target (h, w)."""
TEXT_TIME = "text_time"

SDXL_GROUPS: dict[str, tuple[str, ...]] = {
    **{k: v for k, v in UNET_GROUPS.items() if k != "pooled_text"},
    "added_conditions": (r"add_embedding\.linear_1", r"add_embedding\.linear_2"),
}
"""LoRA/DoRA target groups: the UNet's, with the pooled-text-and-sizes embedding in place of the pooled-text one."""


class SDXLFamily(UNetFamily):
    """``models.denoiser.family: sdxl``: the unet family's model class, build (output projections zeroed), sizes
    and FSDP blocks, with SDXL's spec, text, micro-conditioning, LoRA file and pipeline."""

    name = "sdxl"
    spec_key = "sdxl"
    text_encoder_classes = ("CLIPTextModel", "CLIPTextModelWithProjection")
    text_encoders = 2
    lora_groups = SDXL_GROUPS
    objectives = ("diffusion", "flow_matching")
    micro_conditioning = True
    controlnet_pipeline = None

    def owns(self, class_name: str, config: Mapping) -> bool:
        return class_name == self.class_name and config.get("addition_embed_type") == TEXT_TIME

    def config(self, spec: dict) -> dict:
        unknown = sorted(set(spec) - set(SPEC_KEYS))
        missing = sorted(set(SPEC_KEYS) - set(spec))
        if unknown or missing:
            raise ValueError(f"SDXL spec keys must be {list(SPEC_KEYS)}; unknown: {unknown}, missing: {missing}")
        config = {k: (tuple(v) if isinstance(v, list) else v) for k, v in spec.items()}
        return {**config, "addition_embed_type": TEXT_TIME}

    def architecture_keys(self) -> tuple[str, ...]:
        return tuple(k for k in SPEC_KEYS if k != "sample_size")  # text_time: the family itself (owns)

    def predict(self, model, x, t, cond):
        inner = getattr(model, "module", model)  # DDP wraps it: its config is the wrapped model's
        sequence, pooled, time_ids = unpack(cond, inner.config.cross_attention_dim, pooled_width(inner.config))
        return model(x, t, encoder_hidden_states=sequence,
                     added_cond_kwargs={"text_embeds": pooled, "time_ids": time_ids}).sample  # fmt: skip

    def encode_text(self, encoders: list, ids: list[torch.Tensor]) -> torch.Tensor:
        sequences = []
        for encoder, encoder_ids in zip(encoders, ids, strict=True):
            out = encoder(encoder_ids, output_hidden_states=True)
            sequences.append(out.hidden_states[-2])
        return pack(torch.cat(sequences, dim=-1), out[0])  # the pooled vector: the last encoder's projection

    def cond_parts(self, widths: list[int], pooled_widths: list[int], tokens: int) -> list[CondPart]:
        spans = zip(["text_encoder", "text_encoder_2"], [0, widths[0]], widths, strict=True)
        parts = [CondPart(n, slice(0, tokens), slice(s, s + w)) for n, s, w in spans]
        return [*parts, CondPart("pooled", slice(tokens, tokens + 1), slice(0, pooled_widths[-1]))]

    def check_text_widths(self, config: dict, widths: list[int], pooled_widths: list[int]) -> None:
        if config["cross_attention_dim"] != sum(widths):
            raise ValueError(f"cross_attention_dim ({config['cross_attention_dim']}) must equal the text encoders' "
                             f"hidden sizes side by side ({' + '.join(map(str, widths))})")  # fmt: skip
        want = pooled_widths[-1] + TIME_IDS * config["addition_time_embed_dim"]
        if config["projection_class_embeddings_input_dim"] != want:
            got = config["projection_class_embeddings_input_dim"]
            raise ValueError(f"projection_class_embeddings_input_dim ({got}) must be the second text encoder's "
                             f"projection ({pooled_widths[-1]}) + 6 × addition_time_embed_dim "
                             f"({config['addition_time_embed_dim']}) = {want}")  # fmt: skip

    def cond_shape(self, config: dict, tokens: int) -> tuple[int, int]:
        return tokens + 2, max(int(config["cross_attention_dim"]), pooled_width(config), TIME_IDS)

    # ------------------------------------------------------------------------------------------ sizes
    def sized(self, cond: torch.Tensor, sizes: torch.Tensor | None) -> torch.Tensor:
        if sizes is None:
            return cond
        row = F.pad(sizes.to(cond.dtype), (0, cond.shape[-1] - TIME_IDS))
        return torch.cat([cond[:, :-1], row[:, None].expand(cond.shape[0], -1, -1)], dim=1)

    def controlled(self, denoiser, vae_factor: int, seed: int, scale: float, channels=None):
        return DenoiserFamily.controlled(self, denoiser, vae_factor, seed, scale, channels)

    def load_controlled(self, denoiser, folder, scale: float):
        return DenoiserFamily.load_controlled(self, denoiser, folder, scale)

    # ------------------------------------------------------------------------------------------ export
    def save_lora(self, folder, layers: dict, metadata: dict, text=None) -> None:
        # lazy: diffusers costs 4-6 s to import (model_class)
        from diffusers.loaders import StableDiffusionXLLoraLoaderMixin

        StableDiffusionXLLoraLoaderMixin.save_lora_weights(
            folder, unet_lora_layers=layers, safe_serialization=True, unet_lora_adapter_metadata=metadata,
            **text_lora_kwargs(text),
        )  # fmt: skip

    def pipeline(self, denoiser, vae, encoders: list, tokenizers: list, scheduler):
        from diffusers import StableDiffusionXLPipeline  # lazy: diffusers costs 4-6 s to import (model_class)

        # force_zeros_for_empty_prompt False: the negative prompt's embedding is the encoded "" the CFG dropout
        # trained, not zeros; no watermark: it would change our pixels
        return StableDiffusionXLPipeline(
            vae=vae, text_encoder=encoders[0], text_encoder_2=encoders[1], tokenizer=tokenizers[0],
            tokenizer_2=tokenizers[1], unet=denoiser, scheduler=scheduler, force_zeros_for_empty_prompt=False,
            add_watermarker=False,
        )  # fmt: skip


def pooled_width(config: Mapping) -> int:
    """The pooled text vector's width: the added-conditions input less the six time ids' embeddings."""
    return int(config["projection_class_embeddings_input_dim"]) - TIME_IDS * int(config["addition_time_embed_dim"])


def pack(sequence: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """``[B, L, D]`` sequence + ``[B, P]`` pooled → ``[B, L + 2, max(D, P, 6)]`` (zero-padded; pooled, then the
    time-ids row at zero)."""
    width = max(sequence.shape[-1], pooled.shape[-1], TIME_IDS)
    rows = F.pad(sequence, (0, width - sequence.shape[-1]))
    pooled_row = F.pad(pooled, (0, width - pooled.shape[-1]))[:, None]
    return torch.cat([rows, pooled_row, torch.zeros_like(pooled_row)], dim=1)


def unpack(cond: torch.Tensor, cross_dim: int, pooled_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The UNet's ``encoder_hidden_states``, ``text_embeds`` and ``time_ids`` from a packed tensor."""
    if cond.shape[-1] < cross_dim:
        raise ValueError(f"text width {cond.shape[-1]} is below the SDXL UNet's cross_attention_dim {cross_dim}")
    return cond[:, :-2, :cross_dim], cond[:, -2, :pooled_dim], cond[:, -1, :TIME_IDS]
