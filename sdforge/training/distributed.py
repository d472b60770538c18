"""Process-group setup that runs unchanged with and without ``torchrun`` (nanoGPT-style), and the RNG scheme.

Randomness (noise, timesteps, CFG drop) is drawn per sample, from a stream seeded from one
generator that every rank holds in the same state (:func:`step_seeds`): each optimizer step draws one seed
per sample of the *global* batch, and a sample's draws depend only on its place in the global batch, not on
the rank, the world size or the accumulation: N ranks with batch B train like one process with batch N·B
(``tests/sdforge/training/test_ddp.py``), and the generator state saved by rank 0 resumes every rank, on any
world size. What else is random per rank (torch's global RNG: adapter dropout) is restored from the
checkpoint at an unchanged world size, and re-derived from (seed, step, rank) when it changed
(:func:`derive_rank_rng`).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Dist:
    """This process's place in the (possibly single-process) job."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed() -> Dist:
    """Read torchrun's env; start the process group (NCCL on CUDA, gloo on CPU) when world > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Dist(rank, world, local_rank, device)


SEED_RANGE = 2**62


def step_seeds(shared: torch.Generator, global_batch: int) -> torch.Tensor:
    """One seed per sample of an optimizer step's global batch (in plan order); ``shared`` advances alike on
    every rank."""
    return torch.randint(SEED_RANGE, (global_batch,), generator=shared)


def part_generators(seeds: torch.Tensor) -> list[torch.Generator]:
    """One CPU generator per sample from its seed (a micro-batch's part of :func:`step_seeds`)."""
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


def derive_rank_rng(seed: int, step: int, rank: int) -> None:
    """Seed this process's python, numpy and torch (CPU, CUDA) RNGs from (seed, step, rank): the per-rank
    streams of a run resumed on another world size, a function of where it resumed only."""
    derived = int(np.random.SeedSequence([seed, step, rank]).generate_state(1, dtype=np.uint64)[0] % SEED_RANGE)
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.manual_seed(derived)  # CPU and every CUDA device


def broadcast_object(value, world: int):
    """Rank 0's ``value`` on every rank (as is on one process)."""
    if world > 1 and torch.distributed.is_initialized():
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return value
