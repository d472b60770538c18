"""Where bf16 autocast runs: the one switch behind ``train.mixed_precision`` and ``encode.mixed_precision`` (which
also offers fp16 for the VAE: :func:`encode_precision`).

bf16 on CUDA when asked; on a CPU only when it computes bf16 natively (AVX512-BF16 or AMX), where it is
faster than fp32 — measured on this project's AVX512-BF16 CPU with the SD1.x UNet at batch 1 and gradient
checkpointing: one training step 26 s in bf16 vs 38 s in fp32 (docs/HISTORY.md, issue 15). A CPU without
native bf16 would emulate it and run slower, so it stays in fp32.
"""

from __future__ import annotations

import torch


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (oneDNN's check: AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without oneDNN
        return False


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The autocast dtype of each reduced precision a stage resolves to (``fp32``: no autocast)."""


def encode_precision(device: torch.device, mixed_precision: str) -> str:
    """The VAE encoder's precision for ``encode.mixed_precision``: ``fp16`` wherever asked (for a card without bf16,
    a V100 or T4; the VAE must be one that does not overflow fp16, docs/SDXL.md), ``bf16`` where
    :func:`uses_bf16_autocast`, else ``fp32``."""
    if mixed_precision == "fp16":
        return "fp16"
    return "bf16" if uses_bf16_autocast(device, mixed_precision) else "fp32"


def uses_bf16_autocast(device: torch.device, mixed_precision: str) -> bool:
    """``mixed_precision: bf16`` → bf16 autocast on CUDA, and on a CPU with native bf16; fp32 otherwise."""
    if mixed_precision != "bf16":
        return False
    return device.type == "cuda" or (device.type == "cpu" and cpu_has_native_bf16())
