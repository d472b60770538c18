"""Benchmark: how long ``train.compile: blocks`` takes to compile the UNet vs ``train.compile: unet``.

``python -m bench.compile_time [--quick] [--config full|demo] [--device auto|cpu|cuda] [--batch N] [--limit S]``

Each mode runs in its own subprocess with its own empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` in a
temp dir, so neither finds the other's kernels): build the config's UNet (seed 0, every block checkpointed
unless the config's ``train.activation_checkpointing`` is off), bf16 autocast where
:func:`model.precision.uses_bf16_autocast` says), :func:`model.speed.compile_unet` it, then three forward +
backward passes of an MSE loss at the config's
latent size (no optimizer: compile covers the forward and backward graphs; AdamW does not change them).
``compile_s`` = the first pass minus the median of the next two (the work of compiling, not of the step);
``dynamo_s`` = torch's own total (:func:`model.speed.compile_seconds`, what the train metrics report as
``compile.seconds``). A mode that does not finish within ``--limit`` seconds is reported as such.

``ratio = unet compile_s / blocks compile_s`` (higher: regional compilation saves more). ``--quick``: the demo
UNet at batch 1; its numbers only prove the plumbing. Last line: ``RESULT name=compile_time ratio=...
blocks_s=... unet_s=... blocks_step_s=... unet_step_s=... eager_step_s=... machine=...``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from bench._common import load_average, machine, result_line
from model.builders import build_unet, unet_config
from model.precision import uses_bf16_autocast
from model.speed import compile_seconds, compile_unet
from sdforge.config import load_params

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"demo": REPO / "params.yaml", "full": REPO / "configs/full/params.yaml"}


def measure_mode(config: str, mode: str, device_name: str, batch: int) -> dict[str, float]:
    """In this process: compile ``mode`` and time three forward + backward passes (see the module docstring)."""
    params = load_params(CONFIGS[config])
    device = torch.device(device_name)
    unet = build_unet(unet_config(params.models.unet.model_dump()), seed=0).to(device).train()
    if params.train.activation_checkpointing != "off":  # full (auto and selective: the trainer plans them)
        unet.enable_gradient_checkpointing()
    compiled = compile_unet(unet, mode)
    spec = params.models.unet
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(batch, spec.in_channels, spec.sample_size, spec.sample_size, generator=gen).to(device)
    cond = torch.randn(batch, 77, spec.cross_attention_dim, generator=gen).to(device)
    timesteps = torch.full((batch,), 500, dtype=torch.long, device=device)
    bf16 = uses_bf16_autocast(device, params.train.mixed_precision)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            pred = unet(latents, timesteps, encoder_hidden_states=cond).sample
        F.mse_loss(pred.float(), latents.float()).backward()
        unet.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[1:])
    return {"compile_s": times[0] - step, "step_s": step, "dynamo_s": compile_seconds(), "modules": compiled}


def run_mode(config: str, mode: str, device: str, batch: int, limit: float) -> dict | None:
    """:func:`measure_mode` in a child with a fresh inductor cache; None when it ran past ``limit`` or failed."""
    with tempfile.TemporaryDirectory(prefix="sdforge-compile-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": f"{cache}/triton"}
        cmd = [sys.executable, "-m", "bench.compile_time", "--child", mode, "--config", config, "--device", device,
               "--batch", str(batch)]  # fmt: skip
        child = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 start_new_session=True)  # fmt: skip
        try:
            stdout, stderr = child.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)  # the compile workers too
            child.communicate()
            print(f"{mode}: no pass within {limit:.0f} s", flush=True)
            return None
    if child.returncode != 0:
        tail = (stderr.strip().splitlines() or ["?"])[-1]
        print(f"{mode}: failed (exit {child.returncode}): {tail}", flush=True)
        return None
    result = json.loads(stdout.strip().splitlines()[-1])
    print(f"{mode}: {json.dumps(result)}", flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the demo UNet (plumbing only)")
    ap.add_argument("--config", choices=sorted(CONFIGS), help="default: full (demo with --quick)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--limit", type=float, default=1800.0, help="seconds per mode before it is given up")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    config = args.config or ("demo" if args.quick else "full")
    if args.child:
        print(json.dumps(measure_mode(config, args.child, args.device, args.batch)))
        return
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    where = machine() + (f", {torch.cuda.get_device_name()}" if device == "cuda" else "")
    print(f"machine: {where}; load {load_average()}; torch {torch.__version__}; config {config}, batch {args.batch}")
    res = {mode: run_mode(config, mode, device, args.batch, args.limit) for mode in ("off", "blocks", "unet")}
    blocks, unet = res["blocks"], res["unet"]
    ratio = unet["compile_s"] / blocks["compile_s"] if blocks and unet and blocks["compile_s"] > 0 else 0.0
    fields = {
        "blocks_s": blocks["compile_s"] if blocks else "timeout",
        "unet_s": unet["compile_s"] if unet else "timeout",
        "blocks_step_s": blocks["step_s"] if blocks else "timeout",
        "unet_step_s": unet["step_s"] if unet else "timeout",
        "eager_step_s": res["off"]["step_s"] if res["off"] else "failed",
        "device": device,
        "config": config,
        "batch": args.batch,
        "load": load_average(),
        "machine": where,
    }
    print(result_line("compile_time", ratio, **fields))


if __name__ == "__main__":
    main()
