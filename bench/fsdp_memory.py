"""Benchmark: the training state each rank holds, replicated (DDP) vs sharded (FSDP2), on CPU (issue 57).

``python -m bench.fsdp_memory [--quick] [--family unet|mmdit] [--ranks N] [--latent S] [--steps K]``

Each variant is its own ``torchrun`` job (gloo, CPU): ``ddp`` at 1 rank (what every DDP rank holds, at any world
size: the whole state) and ``fsdp`` at ``--ranks`` ranks (``--fsdp1``: also at 1 rank, the wrapper alone). A
worker builds the full config's denoiser (``configs/full/params.yaml``; ``--quick``: the demo's) from seed 0,
shards it as the trainer does (:func:`model.sharding.shard_model`, one unit per block of the family) or wraps it in
DDP, builds the trainer's :class:`sdforge.training.optimization.Optimization` (AdamW, the EMA; no post-hoc EMA),
and takes ``--steps`` optimizer steps at batch 1 on random ``S×S`` latents with gradient checkpointing (the shipped
setting).
Per rank it reports the state counted from its tensors' local storage (weights, gradients, AdamW's moments, the
EMA's shadow weights) and its peak RSS (``VmHWM``), which also holds the build (every rank builds the whole model
before sharding it), the activations and the libraries.

The last line: ``RESULT name=fsdp_memory ratio=<ddp's state per rank ÷ fsdp's at --ranks> ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from bench._common import machine, result_line
from model.denoisers import family
from model.sharding import shard_model
from sdforge.config import load_params
from sdforge.training.distributed import init_distributed
from sdforge.training.optimization import Optimization
from sdforge.training.parallel import ensure_process_group

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"full": REPO / "configs/full/params.yaml", "demo": REPO / "params.yaml"}
GIB = 2**30


def _local_bytes(tensors) -> int:
    """Bytes of this rank's storage behind ``tensors`` (a shard's local part; a whole tensor's all)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _model(params, fam_name: str, parallel: str, dist):
    fam = family(fam_name)
    config = fam.config(_spec(params, fam))
    model = fam.build(config, seed=0).train()
    model.enable_gradient_checkpointing()
    if parallel == "fsdp":
        ensure_process_group(dist)
        shard_model(model, fam.shard_blocks, dist.device, bf16=False)
        forward = model
    else:
        forward = torch.nn.parallel.DistributedDataParallel(model) if dist.world > 1 else model
    return fam, config, model, forward


def _spec(params, fam):
    """The family's architecture in ``params`` (the full config's ``models.mmdit`` defaults to the 1.2B preset)."""
    denoiser = params.models.denoiser.model_copy(update={"family": fam.name})
    return params.models.model_copy(update={"denoiser": denoiser}).denoiser_spec


def worker(args) -> None:
    """One rank: build, step, print one JSON line of figures."""
    dist = init_distributed()
    params = load_params(CONFIGS["demo" if args.quick else "full"])
    fam_name = args.family or params.models.denoiser.family
    fam, config, model, forward = _model(params, fam_name, args.parallel, dist)
    built_rss = _peak_rss_gib()
    phase = next(iter(params.phases.values()))
    # the post-hoc EMA's profiles (two more fp32 copies in the full config) are off: sharded runs refuse them
    cfg = params.train.model_copy(update={"ema_device": "model", "ema_update_every": 1, "posthoc_sigma_rels": []})
    optim = Optimization(list(model.parameters()), phase, cfg, dist.device, "bench", model)
    optim.plan(max(10, args.steps))
    gen = torch.Generator().manual_seed(dist.rank)
    size = args.latent or config["sample_size"]
    grads = 0
    for step in range(1, args.steps + 1):
        latents = torch.randn(1, config["in_channels"], size, size, generator=gen)
        cond = torch.randn(1, *fam.cond_shape(config, 77), generator=gen)
        t = torch.randint(0, 1000, (1,), generator=gen)
        loss = fam.predict(forward, latents, t, cond).float().pow(2).mean()
        loss.backward()
        grads = _local_bytes([p.grad for p in model.parameters()])
        optim.step(step)
    moments = _local_bytes(t for s in optim.optimizer.state.values() for t in s.values() if t.dim() > 0)
    figures = {
        "rank": dist.rank, "world": dist.world, "parallel": args.parallel, "family": fam_name,
        "params": sum(p.numel() for p in model.parameters()),
        "weights_gib": _local_bytes(model.parameters()) / GIB, "grads_gib": grads / GIB,
        "moments_gib": moments / GIB, "ema_gib": _local_bytes(optim.ema.shadow_params) / GIB,
        "built_rss_gib": built_rss, "peak_rss_gib": _peak_rss_gib(), "latent": size,
    }  # fmt: skip
    figures["state_gib"] = sum(figures[k] for k in ("weights_gib", "grads_gib", "moments_gib", "ema_gib"))
    print("FIGURES " + json.dumps(figures), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _launch(args, parallel: str, ranks: int) -> list[dict]:
    """One torchrun job; every rank's figures."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "-m", "bench.fsdp_memory", "--worker", "--parallel", parallel, "--steps", str(args.steps)]  # fmt: skip
    cmd += ["--quick"] if args.quick else []
    cmd += ["--family", args.family] if args.family else []
    cmd += ["--latent", str(args.latent)] if args.latent else []
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "1048576", "OMP_NUM_THREADS": str(
        max(1, (os.cpu_count() or 1) // ranks))}  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    rows = [json.loads(line[8:]) for line in done.stdout.splitlines() if line.startswith("FIGURES ")]
    if done.returncode != 0 or len(rows) != ranks:
        raise SystemExit(f"{parallel} x{ranks} failed (rc {done.returncode}):\n{done.stderr[-3000:]}")
    return sorted(rows, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the demo's tiny denoiser (seconds)")
    ap.add_argument("--family", choices=["unet", "mmdit"], help="default: the config's")
    ap.add_argument("--ranks", type=int, default=2, help="fsdp's world size (default 2)")
    ap.add_argument("--latent", type=int, help="latent side (default: the config's sample_size)")
    ap.add_argument("--steps", type=int, default=1, help="optimizer steps per rank (default 1)")
    ap.add_argument("--fsdp1", action="store_true", help="also fsdp on 1 rank (the wrapper alone: the whole state "
                    "plus its buffers; at full size it does not fit a 24 GiB box beside nothing else)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--parallel", default="ddp", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    print(f"machine: {machine()}; torch {torch.__version__}; gloo, CPU")
    variants = [("ddp", 1)] + ([("fsdp", 1)] if args.fsdp1 else []) + [("fsdp", args.ranks)]
    results = {(p, n): _launch(args, p, n) for p, n in variants}
    first = results[("ddp", 1)][0]
    print(f"{first['family']}: {first['params']:,} parameters, batch 1, {first['latent']}x{first['latent']} latents, "
          f"{args.steps} step(s), fp32, gradient checkpointing")  # fmt: skip
    print("variant     rank  weights  grads  moments  EMA    state GiB  RSS after build  peak RSS GiB")
    for (parallel, ranks), rows in results.items():
        for r in rows:
            print(f"{parallel} x{ranks:<6} {r['rank']:<4}  {r['weights_gib']:7.2f} {r['grads_gib']:6.2f} "
                  f"{r['moments_gib']:8.2f} {r['ema_gib']:6.2f} {r['state_gib']:10.2f} {r['built_rss_gib']:16.2f} "
                  f"{r['peak_rss_gib']:13.2f}")  # fmt: skip
    ddp, fsdp = first, max(results[("fsdp", args.ranks)], key=lambda r: r["state_gib"])
    peak_ddp = first["peak_rss_gib"]
    peak_fsdp = max(r["peak_rss_gib"] for r in results[("fsdp", args.ranks)])
    print(result_line("fsdp_memory", ddp["state_gib"] / fsdp["state_gib"], ddp_state_gib=round(ddp["state_gib"], 3),
                      fsdp_state_gib=round(fsdp["state_gib"], 3), ranks=args.ranks,
                      ddp_peak_rss_gib=round(peak_ddp, 2), fsdp_peak_rss_gib=round(peak_fsdp, 2),
                      family=first["family"], params=first["params"], latent=first["latent"],
                      config="demo" if args.quick else "full", machine=machine()))  # fmt: skip


if __name__ == "__main__":
    main()
