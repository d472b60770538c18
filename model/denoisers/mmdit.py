"""The MM-DiT family (SD3's backbone): diffusers' ``SD3Transformer2DModel`` under two CLIP text encoders with
projection, trained with rectified flow. Sampled by ``StableDiffusion3Pipeline`` with
``FlowMatchEulerDiscreteScheduler``.

**Conditioning, as SD3 builds it** (``StableDiffusion3Pipeline.encode_prompt`` without its T5): each CLIP's
penultimate hidden state ``[B, L, D_i]``, side by side ``[B, L, D_1 + D_2]``, zero-padded to the transformer's
``joint_attention_dim``; the pooled vector is
both encoders' projected pooled outputs side by side ``[B, P_1 + P_2]`` (= ``pooled_projection_dim``). This project
trains without a T5 and with no zero rows in its place (they would cost as much as image tokens: 256 of them is 4×
the demo's 64), so an export is called with ``max_sequence_length=0`` (``StableDiffusion3Pipeline`` otherwise adds
256 zero rows, a different model input; the export's ``sdforge_export.json`` says so). The packed
tensor this project passes around (:mod:`model.denoisers.base`) is the two sequences side by side, plus one last row
holding the pooled vector: ``[B, L + 1, max(D_1 + D_2, P_1 + P_2)]``; :meth:`MMDiTFamily.predict` unpacks it.

**Init** from scratch as DiT's adaLN-Zero: every block's modulation (``norm1``/``norm1_context``) and the output
norm's modulation and projection start at zero, so each block starts as the identity and the model outputs 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.denoisers.base import CondPart, DenoiserFamily, text_lora_kwargs
from model.seeding import seeded

SPEC_KEYS = ("sample_size", "patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
             "num_attention_heads", "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim",
             "pos_embed_max_size", "qk_norm")  # fmt: skip
"""The ``SD3Transformer2DModel`` config keys a ``models.mmdit`` spec sets."""
PIPELINE_CALL = {"max_sequence_length": 0}
"""What a ``StableDiffusion3Pipeline`` call of an export needs beyond the prompt to draw our images: no T5 rows."""
PIPELINE_LOAD = {"text_encoder_3": None, "tokenizer_3": None}
"""What its ``from_pretrained`` needs: no T5 (diffusers' documented way to run SD3 without it)."""

MMDIT_GROUPS: dict[str, tuple[str, ...]] = {
    "attention": (r"attn\.to_q", r"attn\.to_k", r"attn\.to_v", r"attn\.to_out\.0"),
    "context_attention": (r"attn\.add_q_proj", r"attn\.add_k_proj", r"attn\.add_v_proj", r"attn\.to_add_out"),
    "feed_forward": (r"ff\.net\.0\.proj", r"ff\.net\.2"),
    "context_feed_forward": (r"ff_context\.net\.0\.proj", r"ff_context\.net\.2"),
    "modulation": (r"norm1\.linear", r"norm1_context\.linear"),
}
"""LoRA/DoRA target groups: the image stream's attention and MLP, the text stream's, and the adaLN modulation."""


class MMDiTFamily(DenoiserFamily):
    """``models.denoiser.family: mmdit``."""

    name = "mmdit"
    class_name = "SD3Transformer2DModel"
    spec_key = "mmdit"
    text_encoder_classes = ("CLIPTextModelWithProjection", "CLIPTextModelWithProjection")
    text_encoders = 2
    lora_groups = MMDIT_GROUPS
    objectives = ("flow_matching",)
    shard_blocks = ("JointTransformerBlock",)
    flow_euler = True
    pipeline_call = PIPELINE_CALL
    pipeline_load = PIPELINE_LOAD

    def model_class(self) -> type:
        # lazy: diffusers costs 4-6 s to import; the sampler imports the registry, and a skipped eval grid, it
        from diffusers import SD3Transformer2DModel

        return SD3Transformer2DModel

    def config(self, spec: dict) -> dict:
        unknown = sorted(set(spec) - set(SPEC_KEYS) - {"preset"})
        missing = sorted(set(SPEC_KEYS) - set(spec))
        if unknown or missing:
            raise ValueError(f"MM-DiT spec keys must be {list(SPEC_KEYS)}; unknown: {unknown}, missing: {missing}")
        return {k: spec[k] for k in SPEC_KEYS}

    def build(self, config: dict, seed: int) -> torch.nn.Module:
        with seeded(seed):
            model = self.model_class()(**config)
        zero_init_modulation(model)
        return model

    def architecture_keys(self) -> tuple[str, ...]:
        return tuple(k for k in SPEC_KEYS if k not in ("sample_size", "pos_embed_max_size"))

    def predict(self, model, x, t, cond):
        inner = getattr(model, "module", model)  # DDP wraps it: its config is the wrapped model's
        sequence, pooled = unpack(cond, inner.config.joint_attention_dim, inner.config.pooled_projection_dim)
        timestep = t.expand(x.shape[0]) if t.ndim else t.reshape(1).expand(x.shape[0])
        return model(hidden_states=x, encoder_hidden_states=sequence, pooled_projections=pooled,
                     timestep=timestep, return_dict=False)[0]  # fmt: skip

    def encode_text(self, encoders: list, ids: list[torch.Tensor]) -> torch.Tensor:
        sequences, pooled = [], []
        for encoder, encoder_ids in zip(encoders, ids, strict=True):
            out = encoder(encoder_ids, output_hidden_states=True)
            pooled.append(out[0])
            sequences.append(out.hidden_states[-2])
        return pack(torch.cat(sequences, dim=-1), torch.cat(pooled, dim=-1))

    def cond_parts(self, widths: list[int], pooled_widths: list[int], tokens: int) -> list[CondPart]:
        rows = tokens + 1
        names = ["text_encoder", *(f"text_encoder_{i + 1}" for i in range(1, len(widths)))]
        starts = [sum(widths[:i]) for i in range(len(widths))]
        spans = zip(names, starts, widths, strict=True)
        parts = [CondPart(n, slice(0, rows - 1), slice(s, s + w)) for n, s, w in spans]
        return [*parts, CondPart("pooled", slice(rows - 1, rows), slice(0, sum(pooled_widths)))]

    def check_text_widths(self, config: dict, widths: list[int], pooled_widths: list[int]) -> None:
        if config["pooled_projection_dim"] != sum(pooled_widths):
            raise ValueError(f"pooled_projection_dim ({config['pooled_projection_dim']}) must equal the text encoders' "
                             f"projection widths side by side ({' + '.join(map(str, pooled_widths))})")  # fmt: skip
        packed = max(sum(widths), sum(pooled_widths))
        if config["joint_attention_dim"] < packed:
            raise ValueError(f"joint_attention_dim ({config['joint_attention_dim']}) must be at least the text "
                             f"encoders' widths side by side ({' + '.join(map(str, widths))})")  # fmt: skip

    def cond_shape(self, config: dict, tokens: int) -> tuple[int, int]:
        return tokens + 1, max(int(config["joint_attention_dim"]), int(config["pooled_projection_dim"]))

    def latent_channels(self, model) -> int:
        return int(model.config.in_channels)

    def trained_side(self, model, vae_factor: int) -> int:
        return int(model.config.sample_size) * vae_factor

    def pixel_multiple(self, model, vae_factor: int) -> int:
        return vae_factor * int(model.config.patch_size)

    lora_prefix = "transformer"

    def save_lora(self, folder, layers: dict, metadata: dict, text=None) -> None:
        from diffusers.loaders import SD3LoraLoaderMixin  # lazy: diffusers costs 4-6 s to import (model_class)

        SD3LoraLoaderMixin.save_lora_weights(
            folder, transformer_lora_layers=layers, safe_serialization=True,
            transformer_lora_adapter_metadata=metadata, **text_lora_kwargs(text),
        )  # fmt: skip

    def pipeline(self, denoiser, vae, encoders: list, tokenizers: list, scheduler):
        from diffusers import StableDiffusion3Pipeline  # lazy: diffusers costs 4-6 s to import (model_class)

        if vae.config.get("shift_factor") is None:  # SD's VAE has none; the pipeline adds it when decoding
            vae.register_to_config(shift_factor=0.0)
        return StableDiffusion3Pipeline(
            transformer=denoiser, scheduler=scheduler, vae=vae, text_encoder=encoders[0], tokenizer=tokenizers[0],
            text_encoder_2=encoders[1], tokenizer_2=tokenizers[1], text_encoder_3=None, tokenizer_3=None,
        )  # fmt: skip


def pack(sequence: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
    """``[B, L, D]`` sequence + ``[B, P]`` pooled → ``[B, L + 1, max(D, P)]`` (zero-padded; pooled last)."""
    width = max(sequence.shape[-1], pooled.shape[-1])
    rows = F.pad(sequence, (0, width - sequence.shape[-1]))
    return torch.cat([rows, F.pad(pooled, (0, width - pooled.shape[-1]))[:, None]], dim=1)


def unpack(cond: torch.Tensor, joint_dim: int, pooled_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformer's ``encoder_hidden_states`` (padded to ``joint_dim``) and ``pooled_projections`` from a
    packed tensor."""
    if cond.shape[-1] > joint_dim:
        raise ValueError(f"text width {cond.shape[-1]} exceeds the MM-DiT's joint_attention_dim {joint_dim}")
    sequence = F.pad(cond[:, :-1], (0, joint_dim - cond.shape[-1]))
    return sequence, cond[:, -1, :pooled_dim]


@torch.no_grad()
def zero_init_modulation(model: torch.nn.Module) -> list[str]:
    """adaLN-Zero: zero every block's ``norm1``/``norm1_context`` modulation, ``norm_out``'s and ``proj_out``."""
    names = [n for n, m in model.named_modules()
             if n == "proj_out" or n.endswith(("norm1.linear", "norm1_context.linear", "norm_out.linear"))]  # fmt: skip
    modules = dict(model.named_modules())
    for name in names:
        modules[name].weight.zero_()
        if modules[name].bias is not None:
            modules[name].bias.zero_()
    return names
