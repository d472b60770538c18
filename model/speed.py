"""The UNet's speed switches that change kernels, not maths: ``torch.compile`` (``train.compile``) and the
attention kernel (``train.attention``). Each is one function here; the trainer and the benchmarks call them.

- :func:`compile_unet`: ``blocks`` compiles the UNet's repeated ResNet and transformer blocks in place
  (regional compilation, the torch recipe and diffusers' ``compile_repeated_blocks``, whose UNet default covers
  only the transformer blocks): each distinct block shape compiles once and is reused, several times faster to
  compile than the whole model. ``unet`` compiles the whole UNet module. Both compile in place
  (``nn.Module.compile``): parameter names, DDP, gradient checkpointing (non-reentrant, per block), adapters
  and the EMA see the same module. Static shapes; the recompile limit is sized for the distinct block shapes ×
  the phase's bucket shapes × 2 (train and eval mode).
- :func:`attention_backends`: the scaled-dot-product-attention kernels one choice allows
  (``torch.nn.attention.sdpa_kernel``): the CUDA-only ones fall back to torch's own choice off CUDA.
"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

REPEATED_BLOCKS = ("ResnetBlock2D", "Transformer2DModel", "JointTransformerBlock")
"""The blocks ``compile: blocks`` compiles: the UNet's (each transformer model holds its norm, projections and blocks)
and the MM-DiT's joint blocks."""
ATTENTION = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
CUDA_ONLY = ("cudnn", "flash", "efficient")


def block_shapes(unet: torch.nn.Module) -> int:
    """Distinct (block class, channels) among the blocks ``compile: blocks`` compiles."""
    seen = set()
    for module in unet.modules():
        name = type(module).__name__
        if name in REPEATED_BLOCKS:
            weights = tuple(tuple(p.shape) for p in module.parameters(recurse=False)) or None
            channels = getattr(module, "in_channels", None), getattr(module, "out_channels", None)
            seen.add((name, channels, weights))
    return len(seen)


def compile_unet(unet: torch.nn.Module, mode: str, bucket_shapes: int = 1) -> int:
    """Compile ``unet`` in place as ``mode`` says (``off``, ``blocks``, ``unet``); the modules compiled."""
    if mode == "off":
        return 0
    if mode not in ("blocks", "unet"):
        raise ValueError(f"compile mode must be off, blocks or unet; got {mode!r}")
    limit = max(8, 2 * max(1, bucket_shapes) * (block_shapes(unet) if mode == "blocks" else 1))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4 * limit)
    if mode == "unet":
        unet.compile(dynamic=False)
        return 1
    blocks = [m for m in unet.modules() if type(m).__name__ in REPEATED_BLOCKS]
    for block in blocks:
        block.compile(dynamic=False)
    return len(blocks)


def compile_seconds() -> float:
    """Wall seconds torch.compile has spent in this process (dynamo + inductor, forward and backward); 0 if unknown."""
    try:
        # lazy: torch._dynamo (~1 s) only once something was compiled; private, the only total torch keeps
        from torch._dynamo.utils import calculate_time_spent

        return float(calculate_time_spent().get("total_wall_time", 0.0))
    except Exception:  # noqa: BLE001 - a torch without it reports no compile time
        return 0.0


def deterministic_attention(choice: str, deterministic: bool, device: torch.device) -> str:
    """The ``train.attention`` a run uses: ``math`` for ``auto`` when ``train.deterministic`` is on with CUDA (torch's
    own choice, flash/efficient, has a non-deterministic backward: two uninterrupted H200 runs differed by step 30,
    while with ``math`` a killed and resumed run matched bit for bit; bench/README.md, 2026-11-27), else ``choice``."""
    return "math" if deterministic and choice == "auto" and device.type == "cuda" else choice


def attention_backends(choice: str, device: torch.device) -> list[SDPBackend] | None:
    """The backends ``train.attention: choice`` allows on ``device``; None: torch's own choice (``auto``, and the
    CUDA-only kernels off CUDA)."""
    if choice == "auto" or (choice in CUDA_ONLY and device.type != "cuda"):
        return None
    return [ATTENTION[choice]]


def attention_context(backends: list[SDPBackend] | None):
    """``sdpa_kernel(backends)``, or a null context for torch's own choice."""
    return contextlib.nullcontext() if backends is None else sdpa_kernel(backends)
