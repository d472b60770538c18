"""Benchmark: the cost of ordering an epoch by aspect-ratio bucket, ours vs the square-only order.

``python -m bench.bucket_plan [--quick] [--samples N] [--buckets K] [--rounds R]``

Issue 18's loader gives each batch one bucket (:func:`sdforge.latents.bucket_batches.plan_epoch`); today's
loader takes a seeded permutation strided by rank (:func:`sdforge.latents.loader.rank_order`). Both are
measured as what a rank does at the start of an epoch: compute the order, then cut every batch's sample
positions (no latent is read: the gather from the memory-mapped store is ``bench.latent_loader``'s). The
bucket ids follow a skewed distribution over K buckets (a few shapes hold most images, as in LAION);
``carry`` mode is timed at epoch 10, where it replays the 10 earlier epochs to know their tails. World 2,
batch 24 per rank (the reference run's). Figures are medians over ``--rounds``.

Last line: ``RESULT name=bucket_plan ratio=<square-only seconds / bucketed (drop) seconds> ...``: below 1
means bucketing costs more; what matters is the absolute figure against a training step (~0.5 s on a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from bench._common import machine, result_line
from sdforge.latents.bucket_batches import BatchSplit, plan_epoch

WORLD, BATCH, SEED = 2, 24, 0


def skewed_buckets(samples: int, buckets: int) -> np.ndarray:
    """A bucket id per sample, bucket k drawn with weight 1/(k+1) (square first, rarer shapes after)."""
    weights = 1 / np.arange(1, buckets + 1)
    return np.random.default_rng(1).choice(buckets, size=samples, p=weights / weights.sum())


def rank_order(num_samples: int, epoch: int, seed: int, rank: int, world: int) -> np.ndarray:
    """The square-only order before buckets (the baseline): a seeded permutation, strided by rank."""
    perm = np.random.default_rng([seed, epoch]).permutation(num_samples)
    usable = (num_samples // world) * world
    return perm[:usable][rank::world]


def batches_per_epoch(num_samples: int, world: int, batch_size: int) -> int:
    """Batches per rank per epoch of the baseline order (the last one may be partial)."""
    return -(-(num_samples // world) // batch_size)


def square_epoch(samples: int, epoch: int) -> int:
    """Today's order on rank 0: the permutation, then every batch's positions; returns the batch count."""
    order = rank_order(samples, epoch, SEED, 0, WORLD)
    n = batches_per_epoch(samples, WORLD, BATCH)
    return len([order[b * BATCH : (b + 1) * BATCH] for b in range(n)])


def bucket_epoch(ids: np.ndarray, epoch: int, tail: str) -> int:
    """The bucketed order on rank 0: the plan, then every batch's positions; returns the batch count."""
    plan = plan_epoch(ids, epoch, SEED, WORLD * BATCH, tail)
    return len(plan.micro_batches(0, BatchSplit(BATCH, 1, WORLD)))


def timed(fn, rounds: int) -> tuple[float, int]:
    """Median seconds of ``fn()`` over ``rounds`` calls, and its last result."""
    times, result = [], 0
    for _ in range(rounds):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10k samples, 3 rounds")
    ap.add_argument("--samples", type=int, default=100_000)
    ap.add_argument("--buckets", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    samples, rounds = (10_000, 3) if args.quick else (args.samples, args.rounds)
    ids = skewed_buckets(samples, args.buckets)
    square_s, square_batches = timed(lambda: square_epoch(samples, 3), rounds)
    drop_s, drop_batches = timed(lambda: bucket_epoch(ids, 3, "drop"), rounds)
    carry_s, _ = timed(lambda: bucket_epoch(ids, 10, "carry"), rounds)
    print(f"{samples} samples, {args.buckets} buckets, world {WORLD} × batch {BATCH}, median of {rounds}")
    print(f"square-only order: {square_s * 1e3:8.1f} ms for {square_batches} batches")
    print(f"bucketed (drop):   {drop_s * 1e3:8.1f} ms for {drop_batches} batches")
    print(f"bucketed (carry, epoch 10): {carry_s * 1e3:8.1f} ms")
    print(result_line(
        "bucket_plan", square_s / drop_s, samples=samples, buckets=args.buckets, square_ms=square_s * 1e3,
        bucket_drop_ms=drop_s * 1e3, bucket_carry_epoch10_ms=carry_s * 1e3,
        bucket_batches_per_s=drop_batches / drop_s, machine=machine(),
    ))  # fmt: skip


if __name__ == "__main__":
    main()
