"""Benchmark: the encode_latents stage (tars → latent shards) vs a bare VAE encode of pre-decoded tensors.

``python -m bench.encode_pipeline [--quick] [--size 32] [--vae demo|sd] [--device cpu|cuda]``

Ours: :func:`stages.encode_latents.run` (tar stream, sha256, decode pool, tokenizer, VAE, fp16
shards + manifest parts written) on ``--images`` synthetic JPEGs in WebDataset tars; its throughput
is the stage's ``images_per_second`` (first tar read to last shard written). ``stage_img_s`` adds
the stage's fixed start-up and finish (loading and fingerprinting the VAE and tokenizer, listing,
the final manifest), which the demo's < 1 s of VAE work does not amortise.
Baseline: the same VAE, batch size and device (bf16 autocast + channels_last on CUDA; bf16 on a CPU
with native bf16, as the stage; fp32 otherwise) encoding the same images already decoded into one
tensor in device memory: the throughput a pipeline would reach if input cost nothing. The two
alternate, ``--rounds`` times.
ratio = median over rounds of (ours / baseline) throughput (1.0: input cost fully hidden).

The VAE has random weights (throughput only): ``demo`` is built like ``prepare_models`` does from
``params.yaml`` ``models.vae_build``; ``sd`` is SD-VAE-ft-mse's architecture (block_out_channels
[128, 256, 512, 512], 2 layers per block, mid-block attention) — use it with ``--size 512`` on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import torch

from bench._common import BENCH_DATA, machine, result_line
from model.builders import build_tiny_vae
from model.latents import encode_latents as vae_encode
from model.latents import uint8_to_model_range
from model.precision import uses_bf16_autocast
from sdforge.config import load_params
from sdforge.demo.models import write_demo_tokenizer
from sdforge.ingest.shards import iter_samples, tar_bytes
from sdforge.latents import inputs as encode_inputs
from stages import encode_latents as encode_stage

FULL_PARAMS = Path(__file__).resolve().parents[1] / "configs/full/params.yaml"
WORDS = ["a", "red", "green", "blue", "circle", "square", "on", "white", "black", "background"]


def default_size(params) -> int:
    """The side of the square bucket of the config's last encoded bucket set (demo: 32, full: 512)."""
    names = params.encode.resolutions or list(params.buckets)
    if not names:
        return params.encode.resolution
    bucket_set = params.buckets[names[-1]]
    return math.isqrt(bucket_set.max_area) if bucket_set.max_area else max(max(s) for s in bucket_set.sizes)


def make_tars(folder: Path, images: int, per_tar: int, size: int) -> Path:
    """``images`` synthetic ``size``² JPEGs with captions in tars of ``per_tar`` (cached on disk)."""
    done = folder / "COMPLETE"
    if done.exists():
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for t in range(-(-images // per_tar)):
        samples = []
        for i in range(t * per_tar, min(images, (t + 1) * per_tar)):
            base = cv2.resize(
                rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), (size, size), interpolation=cv2.INTER_CUBIC
            )
            noisy = np.clip(base.astype(np.int16) + rng.integers(-12, 13, base.shape), 0, 255).astype(np.uint8)
            ok, buf = cv2.imencode(".jpg", noisy, [cv2.IMWRITE_JPEG_QUALITY, 95])
            assert ok
            text = f"a {rng.choice(WORDS[1:4])} {rng.choice(WORDS[4:6])} on a white background"
            samples.append({"__key__": f"{t:05d}{i:06d}", "jpg": buf.tobytes(), "txt": text, "json": "{}"})
        (folder / f"{t:05d}.tar").write_bytes(tar_bytes(samples))
    done.touch()
    return folder


def build_vae(kind: str):
    if kind == "sd":
        from diffusers import AutoencoderKL

        torch.manual_seed(0)
        return AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(128, 256, 512, 512),
            layers_per_block=2,
            latent_channels=4,
            norm_num_groups=32,
            sample_size=512,
            scaling_factor=0.18215,
        )
    vb = load_params("params.yaml").models.vae_build
    vae = build_tiny_vae(vb.block_out_channels, vb.layers_per_block, vb.latent_channels, seed=0)
    vae.register_to_config(scaling_factor=0.5)
    return vae


def decoded_tensor(tars: Path, size: int) -> torch.Tensor:
    """Every image of ``tars`` decoded: uint8 ``[N, H, W, 3]`` RGB."""
    images = [
        cv2.cvtColor(cv2.imdecode(np.frombuffer(files["jpg"], np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        for _, files in iter_samples(tars)
    ]
    assert all(img.shape == (size, size, 3) for img in images)
    return torch.from_numpy(np.stack(images))


def baseline(vae, images: torch.Tensor, batch_size: int, device: str, bf16: bool) -> float:
    """Images per second of the bare VAE encode on pre-decoded tensors already on ``device``."""
    cuda = device == "cuda"
    x_all = uint8_to_model_range(images.to(device), channels_last=cuda)
    on_bf16 = uses_bf16_autocast(torch.device(device), "bf16" if bf16 else "no")  # the stage's switch
    autocast = torch.autocast(device, dtype=torch.bfloat16) if on_bf16 else contextlib.nullcontext()
    out = []
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode(), autocast:
        for i in range(0, x_all.shape[0], batch_size):
            out.append(vae_encode(vae, x_all[i : i + batch_size]).to(torch.float16))
    latents = torch.cat(out).cpu()
    seconds = time.perf_counter() - t0
    assert latents.shape[0] == images.shape[0]
    return images.shape[0] / seconds


class _FreeDecode:
    """Stands in for ``cv2`` in :mod:`sdforge.latents.inputs`: ``imdecode`` returns a copy of a ready
    image (``--free-decode``: the ratio the pipeline would reach with a zero-cost JPEG decoder)."""

    def __init__(self, size: int):
        self.image = np.zeros((size, size, 3), np.uint8)

    def imdecode(self, buf, flags):
        return self.image.copy()

    def __getattr__(self, name):
        return getattr(cv2, name)


def ours(cfg, tars: Path, models: Path, out: Path, free_decode: bool = False) -> tuple[float, float, dict]:
    """Images per second of the pipeline (first tar read to last shard written) and of the whole
    stage (+ loading the VAE and tokenizer, fingerprinting them, the final manifest), and its metrics."""
    from unittest import mock

    shutil.rmtree(out, ignore_errors=True)
    patch = (
        mock.patch.object(encode_inputs, "cv2", _FreeDecode(cfg.resolution))
        if free_decode
        else contextlib.nullcontext()
    )
    t0 = time.perf_counter()
    with patch:
        metrics = encode_stage.run(cfg, "bench", tars, models, out)
    return metrics["images_per_second"], metrics["samples"] / (time.perf_counter() - t0), metrics


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.encode_pipeline", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="512 images, 3 rounds (under a minute on the demo VAE)")
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--per-tar", type=int, default=250)
    parser.add_argument("--size", type=int, help="image side (default: the last bucket set's square)")
    parser.add_argument("--vae", choices=["demo", "sd"], default="demo")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--batch-size", type=int, help="default: params.yaml encode.batch_size")
    parser.add_argument("--workers", type=int, help="decode workers (default: params.yaml encode.decode_workers)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument(
        "--free-decode", action="store_true", help="replace the JPEG decode by a copy (the ratio's ceiling without it)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    # the SD VAE runs with the full config's encode section (bf16, channels_last, its decode workers), the demo
    # VAE with the demo's: a GPU run of `--vae sd` once measured the demo's fp32 setting by mistake (bench/README.md)
    params = load_params(FULL_PARAMS if args.vae == "sd" else "params.yaml")
    encode = params.encode
    if args.quick:
        args.images, args.rounds = 512, 3
    size = args.size or default_size(params)
    cfg = encode.model_copy(
        update={
            "device": args.device,
            "resolution": size,
            "batch_size": args.batch_size or encode.batch_size,
            "decode_workers": args.workers or encode.decode_workers,
        }
    )
    tars = make_tars(
        BENCH_DATA / "encode_pipeline" / f"{size}px-{args.images}-{args.per_tar}", args.images, args.per_tar, size
    )
    vae = build_vae(args.vae).eval()
    images = decoded_tensor(tars, size)
    with tempfile.TemporaryDirectory(prefix="bench-encode-") as tmp:
        models = Path(tmp) / "models"
        vae.save_pretrained(models / "vae")
        write_demo_tokenizer(WORDS, models / "tokenizer", 77)
        vae = vae.to(args.device)
        if args.device == "cuda" and cfg.channels_last:
            vae = vae.to(memory_format=torch.channels_last)
        baseline(vae, images[: cfg.batch_size], cfg.batch_size, args.device, cfg.mixed_precision == "bf16")  # warm-up
        base_runs, our_runs, stage_runs, metrics = [], [], [], {}
        for r in range(args.rounds):  # alternate which goes first: drift on a shared machine hits both
            for which in ("baseline", "ours") if r % 2 == 0 else ("ours", "baseline"):
                if which == "baseline":
                    base_runs.append(baseline(vae, images, cfg.batch_size, args.device, cfg.mixed_precision == "bf16"))
                else:
                    ips, stage_ips, metrics = ours(cfg, tars, models, Path(tmp) / "out", args.free_decode)
                    our_runs.append(ips)
                    stage_runs.append(stage_ips)
            print(
                f"round {r + 1}: baseline {base_runs[-1]:.1f} img/s, pipeline {our_runs[-1]:.1f} img/s "
                f"(whole stage {stage_runs[-1]:.1f} img/s)",
                flush=True,
            )
    ratios = [o / b for o, b in zip(our_runs, base_runs, strict=True)]
    base, our = statistics.median(base_runs), statistics.median(our_runs)
    print(json.dumps({k: metrics[k] for k in ("samples", "shards", "encode_wait_fraction", "device", "precision")}))
    print(
        result_line(
            "encode_pipeline",
            statistics.median(ratios),
            pipeline_img_s=our,
            stage_img_s=statistics.median(stage_runs),
            baseline_img_s=base,
            images=args.images,
            size=size,
            vae=args.vae,
            device=args.device,
            batch_size=cfg.batch_size,
            decode_workers=cfg.decode_workers,
            precision=metrics["precision"],
            free_decode=args.free_decode,
            torch_threads=torch.get_num_threads(),
            rounds=args.rounds,
            ratio_min=min(ratios),
            ratio_max=max(ratios),
            wait_fraction=float(metrics["encode_wait_fraction"]),
            load=os.getloadavg()[0],
            machine=machine(),
        )
    )


if __name__ == "__main__":
    main()
