"""Training data from a phase index over the latent store: deterministic per-epoch, per-rank batches.

Every rank sees a disjoint slice of the epoch's permutation (same length on every rank, so DDP
ranks step together), and iteration can start at any batch offset without touching the skipped
batches (mid-epoch resume).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl
import torch
from safetensors import safe_open

from stages.common import InputError

log = logging.getLogger(__name__)


def _shard_path(latents_dir: Path, source: str, shard: int) -> Path:
    return latents_dir / source / f"shard-{shard:05d}.safetensors"


class LatentIndexDataset:
    """The samples a phase index points at, gathered from the latent shards into memory."""

    def __init__(self, index_path: Path, latents_dir: Path):
        index = pl.read_parquet(index_path)
        if index.height == 0:
            raise InputError(f"{index_path}: the phase index is empty")
        latents = []
        for (source, shard), group in index.with_row_index("pos").group_by(["source", "shard"], maintain_order=True):
            path = _shard_path(latents_dir, source, shard)
            if not path.is_file():
                raise InputError(
                    f"{index_path}: points at {path}, which does not exist (re-run encode_latents@{source})"
                )
            with safe_open(str(path), framework="pt") as f:
                rows = torch.from_numpy(group["row"].to_numpy().copy())
                latents.append(
                    (group["pos"].to_numpy(), f.get_tensor("latents")[rows], f.get_tensor("input_ids")[rows])
                )
        order = np.concatenate([p for p, _, _ in latents])
        inverse = torch.as_tensor(np.argsort(order))
        self.latents = torch.cat([lat for _, lat, _ in latents])[inverse]
        self.input_ids = torch.cat([i for _, _, i in latents])[inverse].long()
        log.info("loaded %d samples %s from %s", len(self), tuple(self.latents.shape[1:]), index_path)

    def __len__(self) -> int:
        return self.latents.shape[0]


def rank_order(num_samples: int, epoch: int, seed: int, rank: int, world: int) -> np.ndarray:
    """Sample positions this rank visits in ``epoch``: a seeded permutation, strided by rank.

    The permutation is truncated to a multiple of ``world`` so every rank has the same length.
    """
    perm = np.random.default_rng([seed, epoch]).permutation(num_samples)
    usable = (num_samples // world) * world
    return perm[:usable][rank::world]


def batches_per_epoch(num_samples: int, world: int, batch_size: int) -> int:
    """Batches per rank per epoch (the last one may be partial)."""
    return -(-(num_samples // world) // batch_size)


def iter_batches(
    data: LatentIndexDataset, epoch: int, seed: int, rank: int, world: int, batch_size: int, start_batch: int = 0
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield ``(batch_index, latents fp32, input_ids)`` from ``start_batch`` to the epoch's end."""
    order = rank_order(len(data), epoch, seed, rank, world)
    for b in range(start_batch, batches_per_epoch(len(data), world, batch_size)):
        pos = torch.as_tensor(order[b * batch_size : (b + 1) * batch_size])
        yield b, data.latents[pos].float(), data.input_ids[pos]
