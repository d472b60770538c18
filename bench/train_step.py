"""Benchmark: one optimizer step of our trainer vs a plain diffusers-style loop, same UNet and batch.

``python -m bench.train_step [--quick] [--config demo|full] [--batch N] [--ckpt off|on|both]``

- ours: the real :meth:`sdforge.training.trainer.Trainer.micro_step` +
  :meth:`~sdforge.training.trainer.Trainer.optimizer_step`
  (noise and timesteps from the trainer's CPU generator, CFG dropout, bf16 autocast on CUDA,
  channels_last as configured, Min-SNR-γ as the config's phase 1, fused AdamW on CUDA, grad clip,
  warmup+cosine LR schedule, :class:`model.diffusion.TrainingEMA` where the config puts it) on a
  ``Trainer`` assembled without data or files (``Trainer.__new__``);
- plain: diffusers ``examples/text_to_image/train_text_to_image.py``'s loop body — ``randn_like``
  noise and ``randint`` timesteps on the device, ``add_noise``, UNet forward under the same autocast,
  ``F.mse_loss``, backward, ``clip_grad_norm_``, default ``AdamW``, ``EMAModel.step`` — on a UNet
  built from the same seed (so the same weights), the same gradient-checkpointing setting, no channels_last.

Both get the same latents ``[B, 4, s, s]`` (``s`` = ``models.unet.sample_size``) and precomputed
text embeddings ``[B, 77, cross_attention_dim]`` (the frozen text encoder is left out of both).
Variants alternate (ours, plain, ours, plain…), each on a freshly built model, warm-up steps
untimed; img/s is batch ÷ the median step time over the timed steps of all its rounds. Peak memory
is ``torch.cuda.max_memory_allocated`` on CUDA, else the process's peak RSS (``VmHWM``, reset
before each variant through ``/proc/self/clear_refs``). FLOPs per training sample are counted
with ``torch.utils.flop_counter`` on the meta device (forward + backward, batch 1, no recomputation;
SD1.5 at 64×64: 2.41 TFLOP); MFU is
achieved FLOP/s ÷ ``--peak-tflops`` (989 TFLOP/s, H100 SXM bf16 dense, on CUDA; none on CPU).

The last line is ``RESULT name=train_step ratio=<ours img/s ÷ plain img/s> ...`` for the first
(config, checkpointing) pair run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from pathlib import Path

import torch

from bench._common import load_average, machine, result_line
from model.builders import build_unet, noise_scheduler, unet_config
from model.diffusion import TrainingEMA, build_lr_scheduler
from sdforge.config import load_params
from sdforge.training.checkpoints import Progress
from sdforge.training.distributed import Dist
from sdforge.training.trainer import Trainer, _adamw

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"demo": REPO / "params.yaml", "full": REPO / "configs/full/params.yaml"}
H100_BF16_DENSE_TFLOPS = 989.0
SD15_TFLOP_PER_SAMPLE_64 = 2.6
"""The issue's estimate for SD1.5 at 64×64 latents (forward + backward ≈ 3 × forward)."""


def _load(config: str):
    return load_params(CONFIGS[config])


def _build_unet(params, device: torch.device, ckpt: bool, channels_last: bool):
    unet = build_unet(unet_config(params.models.unet.model_dump()), seed=0).to(device).train()
    if ckpt:
        unet.enable_gradient_checkpointing()
    if channels_last:
        unet.to(memory_format=torch.channels_last)
    return unet


class _Embeddings(torch.nn.Module):
    """Stands in for the frozen text encoder: returns the precomputed embeddings."""

    def __init__(self, cond: torch.Tensor):
        super().__init__()
        self.cond = cond

    def forward(self, input_ids):
        return (self.cond,)


def _ours(params, device, batch, ckpt):
    """A Trainer with the real step methods, built without data or files."""
    tr = Trainer.__new__(Trainer)
    tr.params, tr.phase_name = params, "bench"
    tr.phase = next(iter(params.phases.values()))
    tr.cfg = params.train.model_copy(update={"gradient_checkpointing": ckpt})
    tr.dist = Dist(rank=0, world=1, local_rank=0, device=device)
    tr.scheduler = noise_scheduler(params.models.noise.model_dump())
    tr.unet = tr.model = _build_unet(params, device, ckpt, tr.cfg.channels_last)
    d = params.models.unet.cross_attention_dim
    tr.text_encoder = _Embeddings(torch.randn(batch, 77, d, generator=torch.Generator().manual_seed(1)).to(device))
    tr.uncond = torch.zeros(1, 77, d, device=device)
    tr.optimizer = _adamw(tr.unet.parameters(), tr.phase.lr, tr.cfg, device)
    tr.lr_scheduler = build_lr_scheduler(tr.optimizer, tr.phase.warmup_steps, 10**6)
    tr.ema = TrainingEMA(tr.unet.parameters(), decay=tr.cfg.ema_decay, every=tr.cfg.ema_update_every)
    tr.ema.to(device if tr.cfg.ema_device == "model" else torch.device("cpu"))
    tr.generator = torch.Generator().manual_seed(0)
    tr.progress = Progress()
    ids = torch.zeros(batch, 77, dtype=torch.long)

    def step(latents):
        tr.micro_step(latents, ids, 1.0, sync=True)
        tr.optimizer_step()

    return step


def _plain(params, device, batch, ckpt):
    """diffusers examples/text_to_image/train_text_to_image.py's loop body."""
    import torch.nn.functional as F
    from diffusers.training_utils import EMAModel

    cfg, phase = params.train, next(iter(params.phases.values()))
    scheduler = noise_scheduler(params.models.noise.model_dump())
    unet = _build_unet(params, device, ckpt, channels_last=False)
    cond = torch.randn(batch, 77, params.models.unet.cross_attention_dim, generator=torch.Generator().manual_seed(1))
    cond = cond.to(device)
    optimizer = torch.optim.AdamW(
        unet.parameters(), lr=phase.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay, eps=cfg.adam_eps
    )
    ema = EMAModel(unet.parameters())
    ema.to(device)
    bf16 = device.type == "cuda" and cfg.mixed_precision == "bf16"

    def step(latents):
        latents = latents.to(device)
        noise = torch.randn_like(latents)
        timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
        noisy = scheduler.add_noise(latents, noise, timesteps)
        if scheduler.config.prediction_type == "epsilon":
            target = noise
        else:
            target = scheduler.get_velocity(latents, noise, timesteps)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            pred = unet(noisy, timesteps, cond).sample
        loss = F.mse_loss(pred.float(), target.float(), reduction="mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ema.step(unet.parameters())
        float(loss.detach())  # the trainer reads the loss every step (a device sync); so does accelerate's logging

    return step


def flops_per_sample(params) -> float:
    """Forward + backward FLOPs of one training sample (batch 1, no checkpoint recomputation; on ``meta``)."""
    from torch.utils.flop_counter import FlopCounterMode

    spec = params.models.unet
    with torch.device("meta"):
        unet = build_unet(unet_config(spec.model_dump()), seed=0)
        x = torch.randn(1, spec.in_channels, spec.sample_size, spec.sample_size)
        cond = torch.randn(1, 77, spec.cross_attention_dim)
        with FlopCounterMode(display=False) as counter:
            unet(x, torch.tensor([500]), cond).sample.float().pow(2).mean().backward()
    return float(counter.get_total_flops())


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")


def _peak_gib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(params, device, batch, ckpt, warmup, steps, rounds) -> dict:
    """Alternate ours/plain for ``rounds``; return img/s (median step), peak memory per variant."""
    spec = params.models.unet
    latents = torch.randn(batch, spec.in_channels, spec.sample_size, spec.sample_size)
    times: dict[str, list[float]] = {"ours": [], "plain": []}
    peak: dict[str, float] = {"ours": 0.0, "plain": 0.0}
    for _ in range(rounds):
        for name, make in (("ours", _ours), ("plain", _plain)):
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            _reset_peak(device)
            torch.manual_seed(0)
            step = make(params, device, batch, ckpt)
            for _ in range(warmup):
                step(latents)
            _sync(device)
            for _ in range(steps):
                t0 = time.perf_counter()
                step(latents)
                _sync(device)
                times[name].append(time.perf_counter() - t0)
            peak[name] = max(peak[name], _peak_gib(device))
            del step
    return {name: (batch / statistics.median(t), peak[name]) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round of 3 steps (demo: batch 8); under a minute on CPU")
    ap.add_argument("--config", choices=sorted(CONFIGS), help="default: full on CUDA, demo on CPU")
    ap.add_argument("--batch", type=int, help="default: 24 for full, the config's phase-1 batch (32) for demo")
    ap.add_argument("--ckpt", choices=["off", "on", "both"], help="gradient checkpointing; default: both on CUDA")
    ap.add_argument("--steps", type=int, help="timed steps per round")
    ap.add_argument("--rounds", type=int)
    ap.add_argument("--peak-tflops", type=float, help=f"for MFU; default {H100_BF16_DENSE_TFLOPS:g} on CUDA")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    config = args.config or ("full" if cuda else "demo")
    params = _load(config)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = params.train.tf32
        torch.backends.cudnn.allow_tf32 = params.train.tf32
    batch = args.batch or (
        24 if config == "full" else 8 if args.quick else next(iter(params.phases.values())).batch_size
    )
    ckpts = {"off": [False], "on": [True], "both": [False, True]}[args.ckpt or ("both" if cuda else "off")]
    steps = args.steps or (3 if args.quick else 15)
    rounds = args.rounds or (1 if args.quick else 3)
    warmup = 1 if args.quick else 3
    peak_tflops = args.peak_tflops or (H100_BF16_DENSE_TFLOPS if cuda else None)
    where = machine() + (f", {torch.cuda.get_device_name(device)}" if cuda else "")
    dtype = "bf16 autocast" if cuda and params.train.mixed_precision == "bf16" else "fp32"
    spec = params.models.unet
    flops = flops_per_sample(params)
    print(f"machine: {where}; load {load_average()}; torch {torch.__version__}")
    print(
        f"config: {config} UNet {list(spec.block_out_channels)} at {spec.sample_size}x{spec.sample_size} latents, "
        f"batch {batch}, {dtype}; {rounds} round(s) x {steps} timed steps after {warmup} warm-up, per variant"
    )
    print(f"FLOPs per training sample (counted): {flops / 1e12:.4g} TFLOP", end="")
    print(f" (issue's SD1.5 estimate {SD15_TFLOP_PER_SAMPLE_64} TFLOP)" if config == "full" else "")
    print(f"MFU peak: {f'{peak_tflops:g} TFLOP/s' if peak_tflops else 'none on CPU (MFU not reported)'}")
    first = None
    for ckpt in ckpts:
        res = measure(params, device, batch, ckpt, warmup, steps, rounds)
        for name, (img_s, mem) in res.items():
            mfu = f"{img_s * flops / (peak_tflops * 1e12):.1%}" if peak_tflops else "n/a"
            print(
                f"  ckpt={'on' if ckpt else 'off':3} {name:5}: {img_s:9.2f} img/s  peak mem {mem:6.2f} GiB  MFU {mfu}"
            )
        ratio = res["ours"][0] / res["plain"][0]
        print(f"  ckpt={'on' if ckpt else 'off':3} ours/plain: {ratio:.3f}")
        first = first or (ckpt, res, ratio)
    ckpt, res, ratio = first
    print(
        result_line(
            "train_step",
            ratio,
            ours_img_s=res["ours"][0],
            plain_img_s=res["plain"][0],
            ours_peak_gib=res["ours"][1],
            plain_peak_gib=res["plain"][1],
            device=device.type,
            config=config,
            batch=batch,
            ckpt="on" if ckpt else "off",
            machine=where,
        )
    )


if __name__ == "__main__":
    main()
