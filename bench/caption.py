"""Benchmark: captioning shards (``sdforge.captions.shards.caption_shards``) vs a bare batched ``generate`` loop.

``python -m bench.caption [--quick] [--images N] [--batch B] [--width W] [--layers L] [--size S] [--rounds R]``

Ours: the path the caption stage runs — read each WebDataset tar, sha256 every image, decode it, plan against the
content cache (empty: every image is new), batched ``generate`` through the processor, judge each caption, write
one parquet per shard atomically. Baseline: the same model, prompt, settings and batch size over the same images
already decoded in memory (processor + ``generate`` + ``batch_decode`` only): the rate captioning would reach if
reading, hashing, judging and writing cost nothing. The two alternate ``--rounds`` times on the same machine.
ratio = median over rounds of ours ÷ baseline images per second (goal ≥ 0.9).

The model is BLIP built locally from its real classes (:func:`sdforge.demo.captioner.build_blip`; random weights:
greedy decoding then runs to ``max_new_tokens``, so every image costs the same).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import cv2
import numpy as np
import torch

from bench._common import machine, result_line
from sdforge.captions.cache import settings_fingerprint
from sdforge.captions.captioner import generate, load_captioner
from sdforge.captions.shards import Captioning, caption_shards
from sdforge.demo.captioner import build_blip
from sdforge.ingest.shards import iter_samples, tar_bytes

WORDS = ["a", "red", "green", "blue", "circle", "square", "triangle", "on", "white", "black", "background"]
PROMPT = "a"
SETTINGS = {"max_new_tokens": 16, "num_beams": 1}


def make_tars(folder: Path, images: int, per_tar: int, size: int) -> None:
    """``images`` seeded noise JPEGs with file-name captions, ``per_tar`` per tar."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for t in range(-(-images // per_tar)):
        samples = []
        for i in range(t * per_tar, min(images, (t + 1) * per_tar)):
            pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
            jpeg = cv2.imencode(".jpg", pixels)[1].tobytes()
            samples.append({"__key__": f"{t:05d}{i:04d}", "jpg": jpeg, "txt": f"IMG_{i:05d}.jpg"})
        (folder / f"{t:05d}.tar").write_bytes(tar_bytes(samples))


def decoded(folder: Path) -> list[np.ndarray]:
    """Every image of the tars, decoded to RGB (the baseline's input)."""
    return [cv2.cvtColor(cv2.imdecode(np.frombuffer(s["jpg"], np.uint8), 1), cv2.COLOR_BGR2RGB)
            for _, s in iter_samples(folder)]  # fmt: skip


def baseline(processor, model, images: list[np.ndarray], batch: int) -> float:
    """Images per second of the bare loop."""
    t0 = time.perf_counter()
    for start in range(0, len(images), batch):
        generate(processor, model, images[start : start + batch], PROMPT, SETTINGS)
    return len(images) / (time.perf_counter() - t0)


def ours(run: Captioning, tars: Path, out: Path) -> float:
    """Images per second of :func:`caption_shards` into an empty output folder."""
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    stats = caption_shards(tars, out, run)
    return stats.images / (time.perf_counter() - t0)


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.caption", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="96 images, 2 rounds: under a minute")
    ap.add_argument("--images", type=int, default=384)
    ap.add_argument("--per-tar", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--size", type=int, default=64, help="image side (the model's input size)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.quick:
        args.images, args.rounds = 96, 2
    return args


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-caption-") as tmp:
        root = Path(tmp)
        build_blip(root / "model", WORDS, width=args.width, layers=args.layers, image_size=args.size)
        processor, model = load_captioner(str(root / "model"))
        make_tars(root / "tars", args.images, args.per_tar, args.size)
        images = decoded(root / "tars")
        bound = partial(generate, processor, model, prompt=PROMPT, settings=SETTINGS)
        fp = settings_fingerprint("bench-blip", None, PROMPT, SETTINGS)
        count = processor.tokenizer
        run = Captioning("bench-blip", None, fp, PROMPT, bound, lambda t: len(count(t)["input_ids"]), args.batch)
        baseline(processor, model, images[: args.batch], args.batch)  # warm-ups: first calls, imports, caches
        ours(run, root / "tars", root / "out")
        base_runs, our_runs = [], []
        for r in range(args.rounds):
            our_runs.append(ours(run, root / "tars", root / "out"))
            base_runs.append(baseline(processor, model, images, args.batch))
            print(f"round {r + 1}: ours {our_runs[-1]:.1f} img/s, bare generate {base_runs[-1]:.1f} img/s")
    ratios = [o / b for o, b in zip(our_runs, base_runs, strict=True)]
    print(
        result_line(
            "caption",
            statistics.median(ratios),
            ours_img_s=statistics.median(our_runs),
            baseline_img_s=statistics.median(base_runs),
            images=args.images,
            batch=args.batch,
            width=args.width,
            layers=args.layers,
            size=args.size,
            max_new_tokens=SETTINGS["max_new_tokens"],
            rounds=args.rounds,
            ratio_min=min(ratios),
            ratio_max=max(ratios),
            torch_threads=torch.get_num_threads(),
            machine=machine(),
        )
    )


if __name__ == "__main__":
    main()
