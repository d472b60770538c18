"""Seeded builds: a block whose random draws come from one seed, leaving the caller's RNG untouched. Pure torch."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with the CPU RNG seeded to ``seed``; restore the caller's RNG state after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
