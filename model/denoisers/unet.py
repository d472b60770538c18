"""The UNet family (SD 1.x): diffusers' ``UNet2DConditionModel`` under one CLIP text encoder's last hidden state.

Its conditioning tensor is that hidden state ``[B, 77, D]`` as it is; the optional pooled-text path
(``addition_embed_type: text``) attention-pools the same tensor inside the UNet. Sampled by
``StableDiffusionPipeline``.
"""

from __future__ import annotations

import torch

from model.denoisers.base import DenoiserFamily, text_lora_kwargs
from model.denoisers.unet_controlnet import ControlledUNet, build_unet_controlnet, like
from model.seeding import seeded

UNET_GROUPS: dict[str, tuple[str, ...]] = {
    "self_attention": (r"attn1\.to_q", r"attn1\.to_k", r"attn1\.to_v", r"attn1\.to_out\.0"),
    "cross_attention": (r"attn2\.to_q", r"attn2\.to_k", r"attn2\.to_v", r"attn2\.to_out\.0"),
    "feed_forward": (r"ff\.net\.0\.proj", r"ff\.net\.2"),
    "resnet_conv": (r"resnets\.\d+\.conv1", r"resnets\.\d+\.conv2"),
    "proj": (r"proj_in", r"proj_out"),
    "time_embedding": (r"resnets\.\d+\.time_emb_proj",),
    "pooled_text": (r"add_embedding\.proj", r"add_embedding\.pool\.[qkv]_proj"),
}
"""LoRA/DoRA target groups in words → module-name suffixes (the table in :mod:`model.adapters`' docstring)."""

# The UNet2DConditionModel config keys this project sets (UNetSpec); everything else keeps the
# diffusers default, which is SD 1.x's value (silu, flip_sin_to_cos, freq_shift 0, ...).
UNET_SPEC_KEYS = (
    "sample_size",
    "in_channels",
    "out_channels",
    "block_out_channels",
    "layers_per_block",
    "down_block_types",
    "up_block_types",
    "cross_attention_dim",
    "attention_head_dim",
    "norm_num_groups",
)
UNET_OPTIONAL_KEYS = {"addition_embed_type": None, "addition_embed_type_num_heads": 64}
"""Spec keys that may be left out, with diffusers' defaults (SD 1.x: no pooled-text embedding)."""


def unet_config(spec: dict) -> dict:
    """``UNet2DConditionModel`` config from a ``UNetSpec`` dict; unknown or missing keys raise."""
    unknown = sorted(set(spec) - set(UNET_SPEC_KEYS) - set(UNET_OPTIONAL_KEYS))
    missing = sorted(set(UNET_SPEC_KEYS) - set(spec))
    if unknown or missing:
        raise ValueError(
            f"UNet spec keys must be {list(UNET_SPEC_KEYS)}; unknown: {unknown}, missing: {missing}"
        )
    config = {k: (tuple(v) if isinstance(v, list) else v) for k, v in {**UNET_OPTIONAL_KEYS, **spec}.items()}
    groups = config["norm_num_groups"]
    bad = [c for c in config["block_out_channels"] if c % groups]
    if bad:
        raise ValueError(f"block_out_channels {list(config['block_out_channels'])} must be divisible by "
                         f"norm_num_groups={groups}; {bad} are not")
    return config


def output_projections(unet: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The layers the reference run zero-initialises, by qualified name.

    Every ResnetBlock2D's ``conv2``, every attention's output projection ``to_out[0]`` (self- and
    cross-attention), every feed-forward's final linear, every Transformer2DModel's
    ``proj_out``, and the UNet's ``conv_out``.
    """
    # lazy: diffusers costs 4-6 s to import; the registry is imported by the sampler, which a skipped eval grid loads
    from diffusers.models.attention import FeedForward
    from diffusers.models.attention_processor import Attention
    from diffusers.models.resnet import ResnetBlock2D
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    found: dict[str, torch.nn.Module] = {"conv_out": unet.conv_out}
    for name, module in unet.named_modules():
        if isinstance(module, ResnetBlock2D):
            found[f"{name}.conv2"] = module.conv2
        elif isinstance(module, Attention):
            found[f"{name}.to_out.0"] = module.to_out[0]
        elif isinstance(module, FeedForward):
            idx = max(i for i, m in enumerate(module.net) if isinstance(m, torch.nn.Linear))
            found[f"{name}.net.{idx}"] = module.net[idx]
        elif isinstance(module, Transformer2DModel):
            found[f"{name}.proj_out"] = module.proj_out
    return found


@torch.no_grad()
def zero_init_output_projections(unet: torch.nn.Module) -> list[str]:
    """Zero the weights and biases of :func:`output_projections`; return their names."""
    layers = output_projections(unet)
    for layer in layers.values():
        layer.weight.zero_()
        if layer.bias is not None:
            layer.bias.zero_()
    return sorted(layers)


def build_unet(config: dict, seed: int) -> torch.nn.Module:
    """A from-scratch ``UNet2DConditionModel`` (seeded), output projections zeroed.

    Works under ``with torch.device("meta"):`` too (shape-only, nothing allocated).
    """
    from diffusers import UNet2DConditionModel  # lazy: diffusers costs 4-6 s to import (output_projections)

    with seeded(seed):
        unet = UNet2DConditionModel(**config)
    zero_init_output_projections(unet)
    return unet


class UNetFamily(DenoiserFamily):
    """``models.denoiser.family: unet``."""

    name = "unet"
    class_name = "UNet2DConditionModel"
    spec_key = "unet"
    text_encoder_classes = ("CLIPTextModel",)
    text_encoders = 1
    lora_groups = UNET_GROUPS
    objectives = ("diffusion", "flow_matching")
    shard_blocks = ("ResnetBlock2D", "Transformer2DModel")
    flow_euler = False

    def owns(self, class_name: str, config) -> bool:
        return class_name == self.class_name and config.get("addition_embed_type") != "text_time"  # text_time: sdxl

    def model_class(self) -> type:
        from diffusers import UNet2DConditionModel  # lazy: diffusers costs 4-6 s to import (output_projections)

        return UNet2DConditionModel

    def config(self, spec: dict) -> dict:
        return unet_config(spec)

    def build(self, config: dict, seed: int) -> torch.nn.Module:
        return build_unet(config, seed)

    def architecture_keys(self) -> tuple[str, ...]:
        return ("block_out_channels", "layers_per_block", "cross_attention_dim", "attention_head_dim",
                "down_block_types", "up_block_types", "in_channels", "out_channels", "addition_embed_type",
                "norm_num_groups")  # fmt: skip

    def predict(self, model, x, t, cond):
        return model(x, t, encoder_hidden_states=cond).sample

    def encode_text(self, encoders: list, ids: list[torch.Tensor]) -> torch.Tensor:
        return encoders[0](ids[0])[0]

    def check_text_widths(self, config: dict, widths: list[int], pooled_widths: list[int]) -> None:
        if config["cross_attention_dim"] != widths[0]:
            raise ValueError(f"cross_attention_dim ({config['cross_attention_dim']}) must equal the text encoder's "
                             f"hidden size ({widths[0]})")  # fmt: skip

    def cond_shape(self, config: dict, tokens: int) -> tuple[int, int]:
        return tokens, int(config["cross_attention_dim"])

    def latent_channels(self, model) -> int:
        return int(model.config.in_channels)

    def trained_side(self, model, vae_factor: int) -> int:
        return int(model.config.sample_size) * vae_factor

    def pixel_multiple(self, model, vae_factor: int) -> int:
        return vae_factor * 2 ** (len(model.config.down_block_types) - 1)

    def controlled(self, denoiser, vae_factor: int, seed: int, scale: float, channels=None) -> ControlledUNet:
        return ControlledUNet(denoiser, build_unet_controlnet(denoiser, vae_factor, seed, channels), scale)

    def load_controlled(self, denoiser, folder, scale: float) -> ControlledUNet:
        from diffusers import ControlNetModel  # lazy: diffusers costs 4-6 s to import (output_projections)

        controlnet = ControlNetModel.from_pretrained(folder, use_safetensors=True)
        return ControlledUNet(denoiser, like(controlnet, denoiser), scale)

    lora_prefix = "unet"
    controlnet_pipeline = "StableDiffusionControlNetPipeline"

    def save_lora(self, folder, layers: dict, metadata: dict, text=None) -> None:
        # lazy: diffusers costs 4-6 s to import (output_projections)
        from diffusers.loaders import StableDiffusionLoraLoaderMixin

        StableDiffusionLoraLoaderMixin.save_lora_weights(
            folder, unet_lora_layers=layers, safe_serialization=True, unet_lora_adapter_metadata=metadata,
            **text_lora_kwargs(text),
        )  # fmt: skip

    def pipeline(self, denoiser, vae, encoders: list, tokenizers: list, scheduler):
        from diffusers import StableDiffusionPipeline  # lazy: diffusers costs 4-6 s to import (output_projections)

        return StableDiffusionPipeline(
            vae=vae, text_encoder=encoders[0], tokenizer=tokenizers[0], unet=denoiser, scheduler=scheduler,
            safety_checker=None, feature_extractor=None, requires_safety_checker=False,
        )  # fmt: skip
