"""The CUDA-only switches, on a GPU: bf16 autocast, fused AdamW, SDPA kernels, channels_last, EMA placement,
pinned encode batches, the train stage's NCCL path. Marked ``gpu``; each skips with its reason without CUDA.

Run: ``pytest -m gpu tests/gpu`` (``bench/gpu/run.sh`` does, on the lent H100).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench.gpu import workspace
from bench.gpu.workspace import TINY_UNET
from model.builders import build_unet, unet_config
from model.diffusion import TrainingEMA
from sdforge.config import Train
from sdforge.latents.inputs import Decoded
from sdforge.latents.pipeline import _make_batch
from sdforge.training.optimizers import build_optimizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU on this machine)"),
]
REPO = Path(__file__).resolve().parents[2]
SMALL_UNET = {
    **TINY_UNET,
    "sample_size": 16,
    "block_out_channels": [64, 128],
    "cross_attention_dim": 64,
    "attention_head_dim": 8,
    "norm_num_groups": 32,
    "in_channels": 4,
    "out_channels": 4,
}


def _unet(channels_last: bool = False):
    unet = build_unet(unet_config(SMALL_UNET), seed=0).cuda().train()
    torch.nn.init.normal_(unet.conv_out.weight, std=0.02)  # zero-initialised: give the output a gradient path
    if channels_last:
        unet.to(memory_format=torch.channels_last)
    return unet


def _batch(n: int = 4):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, 16, 16, generator=gen).cuda()
    cond = torch.randn(n, 77, 64, generator=gen).cuda()
    return x, torch.full((n,), 500, device="cuda"), cond


def test_bf16_autocast_step_is_finite_and_close_to_fp32():
    x, t, cond = _batch()
    losses = {}
    for bf16 in (False, True):
        unet = _unet()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            pred = unet(x, t, cond).sample
        loss = F.mse_loss(pred.float(), x)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in unet.parameters() if p.grad is not None])
        assert torch.isfinite(grads).all() and torch.isfinite(loss)
        losses[bf16] = (loss.item(), grads)
    assert abs(losses[True][0] - losses[False][0]) <= 0.02 * losses[False][0]
    cosine = F.cosine_similarity(losses[True][1], losses[False][1], dim=0).item()
    assert cosine > 0.99, cosine


def test_fused_adamw_is_chosen_on_cuda():
    opt = build_optimizer("adamw", _unet().parameters(), 1e-4, Train(), torch.device("cuda"), "train")
    assert opt.defaults["fused"] is True
    cpu = build_optimizer("adamw", torch.nn.Linear(2, 2).parameters(), 1e-4, Train(), torch.device("cpu"), "train")
    assert not cpu.defaults.get("fused")


@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
def test_sdpa_runs_the_unet_on_a_fused_kernel(backend):
    """Restricted to one fused backend, the UNet's attention still runs (it would raise if only math fitted)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    x, t, cond = _batch()
    unet = _unet()
    with sdpa_kernel([getattr(SDPBackend, backend)]), torch.autocast("cuda", dtype=torch.bfloat16):
        pred = unet(x, t, cond).sample
    pred.float().pow(2).mean().backward()
    assert torch.isfinite(pred).all()


def test_channels_last_is_kept_through_a_step():
    unet = _unet(channels_last=True)
    opt = build_optimizer("adamw", unet.parameters(), 1e-4, Train(), torch.device("cuda"), "train")
    x, t, cond = _batch()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        pred = unet(x.contiguous(memory_format=torch.channels_last), t, cond).sample
    F.mse_loss(pred.float(), x).backward()
    opt.step()
    convs = [m for m in unet.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size != (1, 1)]
    assert convs and all(c.weight.is_contiguous(memory_format=torch.channels_last) for c in convs)
    assert all(c.weight.grad.is_contiguous(memory_format=torch.channels_last) for c in convs)


def test_cpu_placed_ema_equals_gpu_ema():
    unet = _unet()
    emas = {}
    for where in ("cuda", "cpu"):
        emas[where] = TrainingEMA(unet.parameters(), decay=0.99, every=1)
        emas[where].to(torch.device(where))
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(5):
        with torch.no_grad():
            for p in unet.parameters():
                p.add_(torch.randn(p.shape, generator=gen, device="cuda"), alpha=0.01)
        for ema in emas.values():
            ema.step(unet.parameters())
    for a, b in zip(emas["cuda"].shadow_params, emas["cpu"].shadow_params, strict=True):
        assert b.device.type == "cpu" and a.device.type == "cuda"
        torch.testing.assert_close(a.cpu(), b, rtol=1e-6, atol=1e-7)


def test_encode_batches_are_pinned_on_cuda():
    samples = [Decoded(f"{i:03d}", "a red circle", np.zeros((32, 32, 3), np.uint8)) for i in range(3)]

    def tokens(captions):
        return torch.zeros(len(captions), 77, dtype=torch.long), [False] * len(captions)

    batch = _make_batch(samples, tokens, torch.device("cuda"), collections.Counter())
    assert batch.images.is_pinned() and batch.images.shape == (3, 32, 32, 3)
    assert not _make_batch(samples, tokens, torch.device("cpu"), collections.Counter()).images.is_pinned()


def test_nccl_process_group_all_reduces(tmp_path):
    """The backend ``init_distributed`` picks on CUDA: one rank, a file store, an all-reduce, a clean teardown."""
    torch.distributed.init_process_group(
        "nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, device_id=torch.device("cuda", 0)
    )
    try:
        t = torch.tensor([2.5], device="cuda")
        torch.distributed.all_reduce(t)
        assert torch.distributed.get_backend() == "nccl" and t.item() == 2.5
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def test_train_stage_under_torchrun_with_one_rank(tmp_path):
    """``torchrun --nproc_per_node 1`` on the train stage on CUDA: trains, checkpoints, rank 0 exports.

    One rank starts no process group (world 1); DDP over NCCL needs 2 GPUs (not lent here).
    """
    params = workspace.build(
        tmp_path,
        TINY_UNET,
        32,
        {"save_steps": 4, "deterministic": False},
        {"epochs": 1, "batch_size": 4, "lr": 1e-3, "warmup_steps": 1},
    )
    # keep the caller's PYTHONPATH: on the GPU machine it holds the carried wheels (pydantic, diffusers)
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "SDFORGE_PROGRESS": "0", "PYTHONPATH": pythonpath}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        "-m",
        "stages.train",
        "--params",
        str(params),
        "--item",
        workspace.PHASE,
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics/train/phase1.json").read_text())
    assert metrics["world_size"] == 1 and metrics["steps"] == 8 and np.isfinite(metrics["final_loss"])
    assert (tmp_path / "checkpoints/phase1/unet_ema/diffusion_pytorch_model.safetensors").is_file()


def test_an_optimizer_step_does_not_synchronise_the_host_until_its_one_read():
    """Issue 38: two micro-batches forward/backward and the optimizer step (clip, fused AdamW, schedule, foreach
    EMA) under ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation raises. The step's one read
    (``sdforge.training.step._read_step``) comes after it."""
    from types import SimpleNamespace

    from model.builders import noise_scheduler
    from sdforge.config import NoiseSchedule, Phase
    from sdforge.training.distributed import Dist, step_seeds
    from sdforge.training.optimization import Optimization
    from sdforge.training.state import TrainState
    from sdforge.training.step import _read_step, micro_step
    from sdforge.training.trained_model import FullUNet

    dist = Dist(0, 1, 0, torch.device("cuda"))
    cfg, phase = Train(ema_decay=0.9), Phase(mix={"a": 1.0}, samples=8, lr=1e-4, warmup_steps=1, cfg_dropout=0.5)
    model = FullUNet(_unet(), dist)
    optim = Optimization(model.trainable, phase, cfg, dist.device, "test", model.unet)
    optim.plan(10)
    scheduler = noise_scheduler(NoiseSchedule().model_dump())
    scheduler.alphas_cumprod = scheduler.alphas_cumprod.cuda()
    _, _, cond = _batch()
    conditioning = SimpleNamespace(encode=lambda ids: cond, uncond=torch.zeros(1, 77, 64, device="cuda"),
                                   scheduler=scheduler)  # fmt: skip
    job = SimpleNamespace(dist=dist, conditioning=conditioning, phase=phase, cfg=cfg, model=model, caption_parts=[],
                          objective="diffusion", attention=None)  # fmt: skip
    state, latents, ids = TrainState(0, 0), torch.randn(4, 4, 16, 16), torch.zeros(4, 77, dtype=torch.long)

    def step(n: int):
        seeds = step_seeds(state.generator, 8)
        losses = [micro_step(job, latents, ids, seeds[k * 4 : (k + 1) * 4], 0.5, sync=k == 1) for k in range(2)]
        return torch.cat(losses), optim.step(n)

    step(1)  # warm-up: allocations, cuDNN's first choices
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses, grad_norm = step(2)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    per_sample, norm = _read_step(losses, grad_norm)
    assert per_sample.shape == (8,) and torch.isfinite(per_sample).all() and norm > 0
