"""FSDP2 sharding of a denoiser: each of its family's blocks is one unit of all-gather and reduce-scatter, the root
holds the rest (torchtitan's per-block ``fully_shard``). Parameters become ``DTensor`` shards of dimension 0 over
the ranks; anything built from them (the optimizer's moments, the EMA's shadow weights) is sharded alike.

Pure torch: the training package decides when (``train.parallel``) and saves the shards
(:mod:`sdforge.training.sharded_state`).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


def shard_model(model: torch.nn.Module, block_classes: tuple[str, ...], device: torch.device, bf16: bool) -> int:
    """Shard ``model`` in place over every rank of the default process group: each module whose class name is in
    ``block_classes``, then the root. ``bf16``: parameters are gathered in bf16 for compute and gradients reduced
    in fp32 (the precision bf16 autocast gives the replicated model); else everything stays fp32. The number of
    units sharded (blocks + the root)."""
    mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    options = {"mesh": mesh} | ({"mp_policy": policy} if policy is not None else {})
    blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
    for block in blocks:
        fully_shard(block, **options)
    # The root reshards after its forward too (FSDP2 keeps a root gathered by default, for the backward to come):
    # a forward without backward — the validation loss, validation images on the EMA weights swapped in — would
    # otherwise leave the root's gathered weights in place, and the next training step would run on them.
    fully_shard(model, reshard_after_forward=True, **options)
    return len(blocks) + 1


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a shard of a distributed tensor (a ``DTensor``)."""
    return isinstance(tensor, DTensor)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a shard (a collective: every rank calls it), or ``tensor`` itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def set_gradient_sync(model: torch.nn.Module, sync: bool) -> None:
    """Whether the next backward reduce-scatters the gradients (off for all but a step's last micro-batch)."""
    model.set_requires_gradient_sync(sync)
