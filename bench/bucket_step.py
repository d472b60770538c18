"""Benchmark: training steps with aspect-ratio buckets vs square-only, same samples, same tiny UNet (CPU).

``python -m bench.bucket_step [--quick] [--samples N] [--rounds R] [--steps S] [--batch B] [--threads T]``

Issue 18's acceptance: "the step rate with buckets is within 5 % of square-only on the same data (CPU
bench)". One latent store under a temporary folder holds the same samples twice, written with
:func:`sdforge.latents.store.write_shard` in shards of 128 rows and indexed by
:func:`stages.mix_phase.build_index`:

- ``square`` (the baseline): every sample in one 192×192 bucket (24×24 latents, 576 latent pixels);
- ``buckets`` (ours): each sample in one of :data:`BUCKETS` — 192×192, 256×144 and 144×256 pixels, i.e.
  24×24, 18×32 and 32×18 latents: exactly 576 latent pixels each (the only even-sided shapes of that
  area with aspect ≤ 2), drawn with weight 1/(k+1) (square most frequent), one file per shard and bucket.

Each variant trains its own copy of the same seed-0 UNet (``bench.gpu.workspace.TINY_UNET``, 4 latent
channels) with batches from the real loader — ``LatentIndexDataset`` + ``rank_batches`` (one bucket per
batch with buckets; the strided permutation square-only) + ``iter_batches``, epochs cycled. A step is:
gather the batch, text embeddings looked up from a fixed random table by its ``input_ids``, DDPM noise
and timesteps, UNet forward, MSE, backward, ``AdamW.step``, loss read (a sync). Variants alternate in one
process: round r runs ``--steps`` steps of each, square first on even rounds; a warm-up before round 0
(untimed) runs each variant until every bucket shape has been seen twice (PyTorch's CPU kernels set up
per shape). Torch runs on ``--threads`` threads (1 by default: less noise on a shared machine).

Rates are steps / summed step seconds over all timed rounds. The buckets all hold the same latent pixel
count as the square, so the ratio per step equals the ratio per sample-pixel. Last line:
``RESULT name=bucket_step ratio=<bucketed steps/s ÷ square steps/s> ...`` (≥ 0.95: within 5 %).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl
import torch

from bench._common import load_average, machine, result_line
from bench.gpu.workspace import TINY_UNET
from model.builders import build_unet, unet_config
from sdforge.config import Phase
from sdforge.latents.bucket_batches import BatchSplit
from sdforge.latents.loader import LatentIndexDataset, iter_batches, rank_batches
from sdforge.latents.store import MANIFEST, resolution_dir, shard_path, write_shard
from stages.mix_phase import build_index

SQUARE = (192, 192)
BUCKETS = [(192, 192), (256, 144), (144, 256)]
"""(width, height) in pixels; latents are 4 × H/8 × W/8: 24×24, 18×32, 32×18 (576 latent pixels each)."""
FACTOR, CHANNELS = 8, 4
SHARD_ROWS = 128
SOURCE = "bench"
SEED = 0


def latent_shape(bucket: tuple[int, int]) -> tuple[int, int, int]:
    return (CHANNELS, bucket[1] // FACTOR, bucket[0] // FACTOR)


def sample_buckets(samples: int) -> np.ndarray:
    """Each sample's position in :data:`BUCKETS`, drawn with weight 1/(k+1), seeded."""
    weights = 1 / np.arange(1, len(BUCKETS) + 1)
    return np.random.default_rng(SEED).choice(len(BUCKETS), size=samples, p=weights / weights.sum())


def write_store(root: Path, resolution: str, bucket_of: np.ndarray, shapes: list[tuple[int, int]]) -> Path:
    """Write ``len(bucket_of)`` samples (sample i in ``shapes[bucket_of[i]]``) as a store at ``resolution``
    plus its phase index; return the index path. Latent values are seeded per sample."""
    samples = len(bucket_of)
    rng = np.random.default_rng(SEED + 1)
    ids = rng.integers(0, 49408, (samples, 77), dtype=np.int32)
    rows = []
    for shard, start in enumerate(range(0, samples, SHARD_ROWS)):
        for b, bucket in enumerate(shapes):
            members = start + np.flatnonzero(bucket_of[start : start + SHARD_ROWS] == b)
            if members.size == 0:
                continue
            latents = rng.standard_normal((members.size, *latent_shape(bucket)), dtype=np.float32)
            path = shard_path(root, SOURCE, resolution, shard, bucket)
            write_shard(path, torch.from_numpy(latents).half(), torch.from_numpy(ids[members]))
            rows += [(f"{i:06d}", shard, bucket[0], bucket[1], row) for row, i in enumerate(members.tolist())]
    manifest = pl.DataFrame(
        rows, schema=["key", "shard", "bucket_width", "bucket_height", "row"], orient="row"
    ).with_columns(pl.lit(SOURCE).alias("source"), pl.lit("c").alias("caption"))
    manifest.write_parquet(resolution_dir(root, SOURCE, resolution) / MANIFEST)
    index = build_index("bench", Phase(mix={SOURCE: 1.0}, samples=samples, lr=1.0), {SOURCE: manifest}, seed=SEED)
    index_path = root / f"index-{resolution}.parquet"
    index.write_parquet(index_path)
    return index_path


class Variant:
    """One side of the comparison: a loader over its store, its own UNet copy and AdamW, timed steps."""

    def __init__(self, name: str, index: Path, root: Path, resolution: str, batch: int, unet, cond_table):
        from diffusers import DDPMScheduler

        self.name, self.batch = name, batch
        self.data = LatentIndexDataset(index, root, resolution)
        self.unet = unet
        self.opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
        self.sched = DDPMScheduler(num_train_timesteps=1000)
        self.cond_table = cond_table
        self.gen = torch.Generator().manual_seed(SEED)
        self.epoch = 0
        self.batches = self._epoch()
        self.times: list[float] = []
        self.shapes: list[tuple[int, int]] = []  # latent (h, w) of each timed step

    def _epoch(self):
        plan = rank_batches(self.data.sample_bucket, self.epoch, SEED, 0, BatchSplit(self.batch, 1, 1))
        plan = [p for p in plan if len(p) == self.batch]  # full batches only: every step the same size
        return iter_batches(self.data, plan)

    def _next(self):
        for _ in range(2):
            try:
                return next(self.batches)
            except StopIteration:
                self.epoch += 1
                self.batches = self._epoch()
        raise RuntimeError("an epoch without a full batch")

    def step(self) -> tuple[tuple[int, int], float]:
        """One training step (batch from the loader included); returns the latent (h, w) and the seconds."""
        t0 = time.perf_counter()
        _, latents, input_ids = self._next()
        cond = self.cond_table[input_ids]
        noise = torch.randn(latents.shape, generator=self.gen)
        t = torch.randint(0, 1000, (latents.shape[0],), generator=self.gen)
        noisy = self.sched.add_noise(latents, noise, t)
        pred = self.unet(noisy, t, cond).sample
        loss = torch.nn.functional.mse_loss(pred, noise)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        float(loss.detach())
        return tuple(latents.shape[2:]), time.perf_counter() - t0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            shape, seconds = self.step()
            self.times.append(seconds)
            self.shapes.append(shape)

    def warm_up(self, at_least: int = 0, limit: int = 200) -> int:
        """Untimed steps until every bucket shape has been seen twice and ``at_least`` steps ran (at most
        ``limit``); returns the count."""
        seen: dict[tuple[int, int], int] = {}
        want = {latent_shape(b)[1:] for b in self.data.buckets}
        n = 0
        while n < limit and (n < at_least or any(seen.get(s, 0) < 2 for s in want)):
            shape, _ = self.step()
            seen[shape] = seen.get(shape, 0) + 1
            n += 1
        return n

    def rate(self) -> float:
        """Steps per second over every timed step."""
        return len(self.times) / sum(self.times)


def build(samples: int, batch: int, root: Path) -> tuple[Variant, Variant]:
    bucket_of = sample_buckets(samples)
    square_index = write_store(root, "square", np.zeros(samples, dtype=np.int64), [SQUARE])
    bucket_index = write_store(root, "buckets", bucket_of, BUCKETS)
    config = unet_config({"in_channels": CHANNELS, "out_channels": CHANNELS, **TINY_UNET})
    seeded = build_unet(config, seed=0).train()
    cond_table = torch.randn(49408, config["cross_attention_dim"], generator=torch.Generator().manual_seed(1))
    square = Variant("square", square_index, root, "square", batch, copy.deepcopy(seeded), cond_table)
    buckets = Variant("buckets", bucket_index, root, "buckets", batch, copy.deepcopy(seeded), cond_table)
    return square, buckets


def measure(samples: int, batch: int, rounds: int, steps: int, root: Path) -> tuple[Variant, Variant, list]:
    """Build both variants under ``root``, warm up, run ``rounds`` alternating rounds; return them and the
    per-round (square steps/s, bucketed steps/s)."""
    square, buckets = build(samples, batch, root)
    square.warm_up(at_least=buckets.warm_up())  # the same number of untimed steps on both sides
    per_round = []
    for r in range(rounds):
        order = (square, buckets) if r % 2 == 0 else (buckets, square)
        got = {}
        for v in order:
            start = len(v.times)
            v.run(steps)
            got[v.name] = steps / sum(v.times[start:])
        per_round.append((got["square"], got["buckets"]))
    return square, buckets, per_round


def per_shape(v: Variant) -> dict[str, tuple[int, float]]:
    """``"HxW"`` latent shape → (timed steps, median ms)."""
    out = {}
    for shape in sorted(set(v.shapes)):
        times = [t for t, s in zip(v.times, v.shapes, strict=True) if s == shape]
        out[f"{shape[0]}x{shape[1]}"] = (len(times), statistics.median(times) * 1e3)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="480 samples, 3 rounds of 10 steps (~35 s)")
    ap.add_argument("--samples", type=int, default=1536)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per variant per round")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args(argv)
    samples, rounds, steps = (480, 3, 10) if args.quick else (args.samples, args.rounds, args.steps)
    torch.set_num_threads(args.threads)
    print(f"machine: {machine()}; torch threads {args.threads}; load average {load_average()}")
    with tempfile.TemporaryDirectory(prefix="bucket_step-") as tmp:
        square, buckets, per_round = measure(samples, args.batch, rounds, steps, Path(tmp))
    bucket_counts = np.bincount(sample_buckets(samples), minlength=len(BUCKETS)).tolist()
    listed = ", ".join(
        f"{w}x{h} → {h // FACTOR}x{w // FACTOR}: {c}" for (w, h), c in zip(BUCKETS, bucket_counts, strict=True)
    )
    print(
        f"{samples} samples, batch {args.batch}; buckets (pixels → latent h×w: samples) {listed}; "
        f"{rounds} rounds × {steps} timed steps per variant, alternating"
    )
    for r, (sq, bu) in enumerate(per_round):
        print(f"round {r}: square {sq:6.2f} steps/s, buckets {bu:6.2f} steps/s, ratio {bu / sq:.3f}")
    for v in (square, buckets):
        shapes = ", ".join(f"{k}: {n} steps, median {ms:.1f} ms" for k, (n, ms) in per_shape(v).items())
        print(f"{v.name:>7}: {v.rate():6.2f} steps/s ({v.rate() * args.batch:.0f} samples/s) — {shapes}")
    ratio = buckets.rate() / square.rate()
    median_ratio = statistics.median(bu / sq for sq, bu in per_round)
    print(f"bucketed / square: {ratio:.3f} over all steps, median of rounds {median_ratio:.3f}; "
          f"load average {load_average()}")  # fmt: skip
    steps_per_bucket = {f"steps_{k}": n for k, (n, _) in per_shape(buckets).items()}
    print(result_line(
        "bucket_step", ratio, bucket_steps_s=buckets.rate(), square_steps_s=square.rate(),
        median_round_ratio=median_ratio, batch=args.batch, samples=samples, rounds=rounds, steps=steps,
        threads=args.threads, **steps_per_bucket, machine=machine(),
    ))  # fmt: skip


if __name__ == "__main__":
    main()
