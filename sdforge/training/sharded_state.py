"""A sharded run's checkpoint tensors (``train.parallel: fsdp``): written with ``torch.distributed.checkpoint`` (DCP),
one file per rank plus DCP's ``.metadata``, read back on any world size.

Every sharded tensor of the checkpoint's state (the live weights, the optimizer's moments, the EMA's shadow weights:
each a ``DTensor``) is pulled out of the state into one flat dict that every rank saves together
(:func:`save_shards`); ``state.pt`` keeps the rest, with ``{"__shard__": key}`` where a tensor was
(:func:`split_shards`). A restore builds the same structure from the run it restores into and lets DCP read each
key into it (:func:`load_shards`): into that run's shards (DCP reshards to its world size) or into whole tensors
(a replicated run resuming a sharded checkpoint). Each rank reads on its own (``no_dist``), so a rank can try a
checkpoint without the others (:mod:`sdforge.training.resume`).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, distribute_tensor

from model.sharding import whole

SHARDS_DIR = "sharded"
"""In a sharded checkpoint: DCP's folder (``__<rank>_0.distcp`` per rank, ``.metadata``) instead of ``unet/``."""
PLACEHOLDER = "__shard__"
LIVE = "live"
"""The live weights' keys in the flat dict: ``live/<state dict name>``."""


def split_shards(state: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` with every ``DTensor`` replaced by ``{"__shard__": key}``, and those tensors by key (the path of
    dict keys and list positions joined by ``/``)."""
    flat: dict[str, torch.Tensor] = {}

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, DTensor):
            flat[path] = value
            return {PLACEHOLDER: path}
        if isinstance(value, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in value.items()}
        if isinstance(value, list | tuple):
            items = [walk(v, f"{path}/{i}") for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    return walk(state, prefix), flat


def live_keys(live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The live weights ``{name: tensor}`` under their flat keys."""
    return {f"{LIVE}/{name}": tensor for name, tensor in live.items()}


def save_shards(flat: dict[str, torch.Tensor], folder: Path) -> None:
    """Every rank writes its part of ``flat`` into ``folder`` (a collective: every rank calls it)."""
    dcp.save(flat, checkpoint_id=str(folder))


def load_shards(saved: Any, current: Any, live: dict[str, torch.Tensor], folder: Path) -> Any:
    """``saved`` (a ``state.pt`` with placeholders) with each placeholder replaced by the tensor at the same place
    in ``current`` (this run's state), and ``live`` (this run's weights, in place), both read from ``folder``.
    Raises if the folder lacks a key or a shape differs."""
    targets = live_keys(live)

    def walk(value: Any, mine: Any) -> Any:
        if isinstance(value, dict) and set(value) == {PLACEHOLDER}:
            if not isinstance(mine, torch.Tensor):
                raise KeyError(f"{value[PLACEHOLDER]}: this run holds no tensor there")
            targets[value[PLACEHOLDER]] = mine
            return mine
        if isinstance(value, dict):
            return {k: walk(v, mine.get(k) if isinstance(mine, dict) else None) for k, v in value.items()}
        if isinstance(value, list | tuple):
            theirs = mine if isinstance(mine, list | tuple) and len(mine) == len(value) else [None] * len(value)
            items = [walk(v, m) for v, m in zip(value, theirs, strict=True)]
            return items if isinstance(value, list) else tuple(items)
        return value

    filled = walk(saved, current)
    with warnings.catch_warnings():  # no_dist is meant: each rank reads its own part (DCP warns it assumes one process)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, checkpoint_id=str(folder), no_dist=True)
    return filled


def distribute_like(saved: Any, current: Any) -> Any:
    """``saved`` (a replicated checkpoint's state: whole tensors) with each tensor that is a ``DTensor`` at the same
    place in ``current`` cut into this rank's shard of it (no communication)."""
    if isinstance(current, DTensor) and isinstance(saved, torch.Tensor) and not isinstance(saved, DTensor):
        whole = saved.to(current.device_mesh.device_type)
        return distribute_tensor(whole, current.device_mesh, current.placements, src_data_rank=None)
    if isinstance(saved, dict) and isinstance(current, dict):
        return {k: distribute_like(v, current.get(k)) for k, v in saved.items()}
    if isinstance(saved, list | tuple) and isinstance(current, list | tuple) and len(saved) == len(current):
        items = [distribute_like(s, c) for s, c in zip(saved, current, strict=True)]
        return items if isinstance(saved, list) else tuple(items)
    return saved


def gathered(tensor: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """The whole of ``tensor`` on the CPU where ``keep``, else None. A shard is all-gathered (a collective: every
    rank calls it, those that do not ``keep`` only help); a whole tensor is returned as it is."""
    full = whole(tensor.detach())
    return full.cpu() if keep else None


def shard_like(tensor: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """A whole ``tensor`` as ``current`` holds it: this rank's shard where ``current`` is a ``DTensor`` (no
    communication), else ``tensor`` on ``current``'s device and dtype."""
    return distribute_like(tensor.to(dtype=current.dtype), current) if isinstance(current, DTensor) else tensor.to(
        current.device, current.dtype)
