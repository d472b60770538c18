"""LoRA / DoRA adapters (peft) on the UNet: which layers, how to add, how to merge.

Pure torch + peft; no I/O. The one place where the layer groups a user names in params
(``phases.<p>.adapter.targets``) become diffusers / transformers module names:

========================  ==========================================================================
group                     modules (a suffix of the module's full name)
========================  ==========================================================================
``self_attention``        ``attn1.to_q``, ``attn1.to_k``, ``attn1.to_v``, ``attn1.to_out.0``
``cross_attention``       ``attn2.to_q``, ``attn2.to_k``, ``attn2.to_v``, ``attn2.to_out.0``
``feed_forward``          ``ff.net.0.proj``, ``ff.net.2`` (the transformer blocks' GEGLU MLP)
``resnet_conv``           ``resnets.<i>.conv1``, ``resnets.<i>.conv2``
``proj``                  ``proj_in``, ``proj_out`` (into and out of each transformer block)
``time_embedding``        ``resnets.<i>.time_emb_proj`` (the timestep embedding into each ResNet)
``pooled_text``           ``add_embedding.proj``, ``add_embedding.pool.q/k/v_proj``: the pooled prompt's path into
                          that embedding (only UNets with ``addition_embed_type: text``, like the demo's)
========================  ==========================================================================

The adapter is peft's (``LoraConfig``, ``use_dora`` for DoRA, Gaussian init: the update starts at zero), added
with the model's own ``add_adapter`` (diffusers' ``PeftAdapterMixin``), so the saved layers
are what diffusers' ``load_lora_weights`` reads.

A text encoder's LoRA (``adapter.text_encoders``) goes on its attention projections, ``self_attn.q_proj``,
``k_proj``, ``v_proj`` and ``out_proj`` (:data:`TEXT_ENCODER_PATTERN`): the layers diffusers' SDXL LoRA scripts
train, added with transformers' own ``add_adapter``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from peft import LoraConfig
from peft.tuners.tuners_utils import BaseTunerLayer

from model.denoisers.unet import UNET_GROUPS  # noqa: F401 - re-exported; the groups live with the family


def target_pattern(groups: Iterable[str], table: dict[str, tuple[str, ...]]) -> str:
    """A regex that peft full-matches against module names: any module whose name is, or ends in ``.`` plus, one
    of ``groups``' suffixes (``add_embedding.proj`` is a top-level module: no dot before it)."""
    unknown = sorted(set(groups) - set(table))
    if unknown:
        raise ValueError(f"unknown adapter target group(s) {unknown}; known: {sorted(table)}")
    suffixes = [s for g in groups for s in table[g]]
    return r"(?:.*\.)?(?:" + "|".join(suffixes) + ")"


TEXT_ENCODER_PATTERN = r"(?:.*\.)?self_attn\.(?:q_proj|k_proj|v_proj|out_proj)"
"""The CLIP text encoder layers a text-encoder LoRA trains (peft full-matches module names against it)."""


def add_text_adapter(encoder: torch.nn.Module, kind: str, rank: int, alpha: float | None,
                     dropout: float) -> list[tuple[str, torch.nn.Parameter]]:  # fmt: skip
    """Freeze ``encoder`` (a CLIP text model) and add a LoRA/DoRA on its attention projections; the trainable
    parameters by name."""
    return add_adapter(encoder, lora_config(kind, rank, alpha, dropout, TEXT_ENCODER_PATTERN))


def lora_config(kind: str, rank: int, alpha: float | None, dropout: float, pattern: str) -> LoraConfig:
    """peft's config for a LoRA (``kind="lora"``) or DoRA (``"dora"``) on the modules ``pattern`` matches.

    ``alpha`` None means ``rank`` (the update's scale ``alpha / rank`` is 1). Gaussian init: ``A ~ N(0, 1/r)``,
    ``B = 0``, so the adapted model starts exactly at its base.
    """
    if kind not in ("lora", "dora"):
        raise ValueError(f"adapter type must be lora or dora; got {kind!r}")
    return LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else rank,
        lora_dropout=dropout,
        target_modules=pattern,
        use_dora=kind == "dora",
        init_lora_weights="gaussian",
    )


def add_adapter(model: torch.nn.Module, config: LoraConfig) -> list[tuple[str, torch.nn.Parameter]]:
    """Freeze ``model``, add the adapter (the model's own ``add_adapter``), return the trainable parameters by name.

    Raises ValueError naming the pattern when it matches no module of ``model``.
    """
    model.requires_grad_(False)
    try:
        model.add_adapter(config)
    except ValueError as err:
        raise ValueError(
            f"adapter targets {config.target_modules!r} match no layer of {type(model).__name__} ({err})"
        ) from None
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError(f"adapter targets {config.target_modules!r} added no trainable weights")
    for _, param in trainable:  # peft gives each adapter its base layer's dtype: on a bf16-held base, back to fp32
        if param.dtype != torch.float32:
            param.data = param.data.float()
    return trainable


def adapter_layers(model: torch.nn.Module) -> list[BaseTunerLayer]:
    """The peft adapter layers inside ``model`` (empty for a plain model)."""
    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def plain_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict under the base model's key names: adapter tensors dropped, ``base_layer`` unwrapped.

    With the adapter merged (:func:`merged`) this is the merged model; unmerged, it is the base.
    """
    state = model.state_dict()
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}


@contextlib.contextmanager
def merged(model: torch.nn.Module) -> Iterator[None]:
    """Within the block the adapter is merged into the base weights (peft's ``merge``: LoRA and DoRA);
    afterwards the base weights are restored bit for bit (peft's ``unmerge`` alone leaves rounding)."""
    layers = adapter_layers(model)
    saved = [layer.get_base_layer().weight.detach().clone() for layer in layers]
    for layer in layers:
        layer.merge()
    try:
        yield
    finally:
        for layer, weight in zip(layers, saved, strict=True):
            layer.unmerge()
            layer.get_base_layer().weight.data.copy_(weight)


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """``(trainable, base)``: parameters with gradients, and those of the model without its adapters."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = sum(v.numel() for v in plain_state_dict(model).values())
    return trainable, base


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Within the block ``model`` computes without its adapters (peft's ``enable_adapters(False)`` on each layer:
    exactly the base layers' output); afterwards they are on again. A distillation phase's frozen teacher is its
    student with the adapter switched off (:mod:`model.consistency`)."""
    layers = adapter_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no adapter to switch off")
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)
