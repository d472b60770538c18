"""Process-group setup that runs unchanged with and without ``torchrun`` (nanoGPT-style), and the RNG scheme.

Randomness (noise, timesteps, CFG drop) is drawn per sample, from a stream seeded from one
generator that every rank holds in the same state (:func:`sample_generators`). A sample's draws
therefore depend only on its place in the *global* micro-batch, not on the rank or the world size:
N ranks with batch B train like one process with batch N·B (``tests/sdforge/training/test_ddp.py``), and the
generator state saved by rank 0 resumes every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

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


def sample_generators(shared: torch.Generator, batch: int, rank: int, world: int) -> list[torch.Generator]:
    """One CPU generator per row of this rank's micro-batch of ``batch`` rows.

    ``shared`` (same state on every rank) gives ``world * batch`` seeds, one per row of the global
    micro-batch; rank ``r`` takes rows ``r::world`` — the striding of
    :func:`sdforge.latents.loader.rank_order`, so row ``j`` of rank ``r`` is the sample that one process
    with batch ``world * batch`` holds in row ``j * world + r``. ``shared`` advances alike on all ranks.
    """
    seeds = torch.randint(SEED_RANGE, (world * batch,), generator=shared)[rank::world]
    return [torch.Generator().manual_seed(int(s)) for s in seeds]
