"""Benchmark: writing one full-size training checkpoint with the real writer vs plain writes (CPU, disk).

``python -m bench.checkpoint_write [--quick] [--dir DIR] [--threads T] [--baseline-first]``

What is written: the training state of an SD1.5-size UNet (``models.unet`` of ``configs/full/params.yaml``,
859,520,964 parameters, fp32, built by :func:`model.builders.build_unet`), as the trainer holds it —
``TrainingEMA`` shadow weights (decay 0.9999), ``AdamW`` (lr 1e-5) with its state populated by one step on
zero gradients (``exp_avg``/``exp_avg_sq`` for every parameter), ``build_lr_scheduler(opt, 1e-5, 100, 1000)`` —
about 3.44 GB of live weights + 3.44 GB EMA + 6.9 GB optimizer state.

- **Ours** = the wall time of :func:`sdforge.training.checkpoints.save_checkpoint` (the UNet via
  ``unet.save_pretrained(folder / "unet", safe_serialization=True)`` as ``FullUNet.write_live`` does,
  ``state.pt`` = ``{optimizer, lr_scheduler, ema, recent_losses, global_batch}`` + progress/loss via
  ``torch.save``, one ``rng-rank0.pt``, ``config.json`` = the full params, then the sha256 + size of every
  file into the ``COMPLETE`` manifest, ``os.replace`` of the temp dir, pruning), followed by ``os.sync()``.
  The split: ``hash_s`` is the time spent in ``checkpoints._file_table`` (the manifest's sha256 pass),
  measured by temporarily wrapping that module function with a timer during the one real call (the
  writer looks it up at call time, so it is the real call that is timed, not a second pass);
  ``write_s = ours_s - hash_s`` (weights + state + RNG + config + manifest + rename + the final sync).
  The UNet write and the ``state.pt``/RNG/config writes are also timed separately (printed, not in RESULT).
- **Baseline** = the plain writes with no manifest, no hashing, no rename:
  ``unet.save_pretrained(dir / "unet", safe_serialization=True)`` + ``torch.save(state, dir / "state.pt")``
  into another directory, followed by ``os.sync()``.

``ratio = baseline_s / ours_s`` (≤ 1 expected: the hashing is the price of a verifiable checkpoint).
``fits_30s`` / ``fits_120s``: whether ours ends within a 30 s (Kubernetes' default
``terminationGracePeriodSeconds``, GCP spot preemption notice) or 120 s (AWS spot interruption notice)
grace period. ``bytes`` = the total size of the written checkpoint directory. Last line:
``RESULT name=checkpoint_write ratio=... ours_s=... baseline_s=... bytes=... write_s=... hash_s=... stall_s=...
first_stall_s=... hold_s=... wait_s=... cost_s=... inline_stall_s=... inline_hold_s=... inline_cost_s=... step_s=...
async_write_s=... scale=... fits_30s=yes|no fits_120s=yes|no machine=...``.

**In the background** (``train.async_checkpoint: on``, :func:`measure_stall`): the real checkpoint manager, each
save followed by real training steps (forward + backward of the same UNet, batch 1, 32×32 latents) until its
write is done. ``stall_s`` = how much longer the step right after the save takes than the same step alone
(median of 3 rounds), ``hold_s`` = how long ``save()`` holds the training thread, ``wait_s`` = how long that
step's optimizer update waits for the snapshot copy, ``cost_s`` = how much longer all the steps until the write
is done take than as many steps alone (the checkpoint's whole price to training: on a CPU the copy and the
write compete with training for the cores), ``first_stall_s`` = the first save's stall (it allocates the host
buffers). ``inline_*``: the same with the copy made on the training thread inside ``save()`` instead of
deferred to the writer thread. ``--scale auto`` (the CPU default) narrows every block width in steps of 0.05
until the state, its host copy and the step's gradients fit in free memory.

Files go to a temporary directory under ``--dir`` (default ``<repo>/.bench/checkpoint_write``, git-ignored,
on the repository's filesystem); ours is deleted before the baseline is written and everything is deleted
at the end, so the free space needed is one checkpoint (~14 GB at full size; checked before writing).
Memory: ~14 GB resident at full size (the safetensors writer serialises from the tensors' own memory).
``--quick``: the same code on a small UNet (block_out_channels (32, 64), one layer per block, cross-attention
dim 32; a few MB) so tests/CI can exercise it in seconds; its timings mean nothing.

Caveats:
- The page cache cannot be dropped without root. Instead ``os.sync()`` runs before each timed region (so
  neither side starts with the other's dirty pages) and at its end, inside the timing (so both include
  getting their bytes to disk, not just into the page cache). The real writer does not fsync; on a node
  that keeps running after the process is killed the unsynced tail would still reach the disk.
- The sha256 pass reads files that were just written, mostly from the page cache (at full size ~14 GB of
  cache next to ~14 GB of process memory on a 24 GiB machine: some of it may have been evicted and re-read
  from disk). Dirty pages written back by the kernel during the hashing overlap it, so the split between
  ``write_s`` and ``hash_s`` is approximate; ``ours_s`` is not.
- One run of each, ours first unless ``--baseline-first`` (the full size is too large to repeat on a shared
  2-core machine), deleting each before the next. The order matters: in the first full run (2026-11-25)
  ours' write phase took 44.6 s for the same two writes that took the baseline, second, 26.0 s — most
  likely the first write of the run paying ~19 s more (fresh blocks on the virtual disk and/or page-cache
  reclaim; not isolated). Treat ``ratio`` as a bound until both orders are measured; ``hash_s`` is the cost the
  writer adds. The model is built before either timed region and is not counted.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from bench._common import load_average, machine, result_line
from model.builders import build_unet, count_parameters, unet_config
from model.diffusion import TrainingEMA, build_lr_scheduler
from sdforge.config import load_params
from sdforge.training import checkpoints
from sdforge.training.async_checkpoint import MEMORY_MARGIN_BYTES, memory_available
from sdforge.training.checkpoint_manager import CheckpointManager
from sdforge.training.checkpoints import Progress, Retention, capture_rng, save_checkpoint
from sdforge.training.distributed import Dist
from sdforge.training.job import JobEvents
from sdforge.training.state import TrainState
from sdforge.training.trained_model import FullUNet

REPO = Path(__file__).resolve().parents[1]
FULL_PARAMS = REPO / "configs" / "full" / "params.yaml"
SD1_UNET_PARAMS = 859_520_964
GRACE_PERIODS = (30, 120)
"""Seconds: Kubernetes' default terminationGracePeriodSeconds / GCP spot notice; AWS spot notice."""
QUICK_UNET = {
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "block_out_channels": [32, 64],
    "layers_per_block": 1,
    "down_block_types": ["CrossAttnDownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D"],
    "cross_attention_dim": 32,
    "attention_head_dim": 8,
    "norm_num_groups": 32,
}
STEP, GLOBAL_BATCH = 1000, 2048


class _Word:
    """A RESULT value printed bare (``yes``), not quoted as :func:`result_line` quotes strings."""

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text


def yes_no(flag: bool) -> _Word:
    return _Word("yes" if flag else "no")


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def build_state(spec: dict, device: str = "cpu") -> tuple[torch.nn.Module, dict, int]:
    """The UNet and the trainer-like state dict (optimizer, scheduler, EMA); returns them and the param count.

    Order keeps the peak low: the optimizer state is made (and the zero gradients freed) before the EMA copy.
    """
    unet = build_unet(unet_config(spec), seed=0).to(device).train()
    n_params = count_parameters(unet)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5)
    for p in unet.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    lr_scheduler = build_lr_scheduler(optimizer, 1e-5, 100, 1000)
    ema = TrainingEMA(list(unet.parameters()), decay=0.9999, model_cls=type(unet), model_config=unet.config)
    state = {
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": lr_scheduler.state_dict(),
        "ema": ema.state_dict(),
        "recent_losses": [],
        "global_batch": GLOBAL_BATCH,
    }
    return unet, state, n_params


def write_ours(unet, state: dict, rng: list, config: dict, run_dir: Path) -> dict[str, float]:
    """``save_checkpoint`` + ``os.sync()``, timed; returns the phase timings (seconds) and the checkpoint's bytes."""
    marks: dict[str, float] = {}

    def write_weights(folder: Path) -> None:
        marks["weights_start"] = time.perf_counter()
        FullUNet(unet, Dist(0, 1, 0, next(unet.parameters()).device)).write_live(folder)
        marks["weights_end"] = time.perf_counter()

    real_file_table = checkpoints._file_table

    def timed_file_table(ckpt: Path):
        marks["hash_start"] = time.perf_counter()
        try:
            return real_file_table(ckpt)
        finally:
            marks["hash_end"] = time.perf_counter()

    os.sync()
    checkpoints._file_table = timed_file_table
    try:
        t0 = time.perf_counter()
        ckpt = save_checkpoint(
            run_dir, Progress(step=STEP, epoch=0, batch=STEP), write_weights, state, Retention(keep_last=2),
            rng=rng, loss=0.1, config=config,
        )  # fmt: skip
        t_saved = time.perf_counter()
        os.sync()
        t_end = time.perf_counter()
    finally:
        checkpoints._file_table = real_file_table
    manifest = checkpoints.read_manifest(ckpt)
    listed = sum(f["size"] for f in manifest["files"].values())
    total = dir_bytes(ckpt)
    assert total - (ckpt / checkpoints.COMPLETE).stat().st_size == listed, "manifest sizes ≠ files on disk"
    return {
        "ours_s": t_end - t0,
        "weights_s": marks["weights_end"] - marks["weights_start"],
        "state_s": marks["hash_start"] - marks["weights_end"],  # state.pt + rng + config.json
        "hash_s": marks["hash_end"] - marks["hash_start"],
        "finish_s": t_saved - marks["hash_end"],  # COMPLETE + os.replace + prune
        "sync_s": t_end - t_saved,
        "bytes": total,
        "unet_bytes": dir_bytes(ckpt / "unet"),
        "state_bytes": (ckpt / checkpoints.STATE).stat().st_size,
        "files": len(manifest["files"]) + 1,
    }


class _StateJob(JobEvents):
    """What :class:`sdforge.training.checkpoint_manager.CheckpointManager` reads of a job, over a built state."""

    def __init__(self, unet, state: dict, params, setting: str):
        super().__init__()
        self.params, self.phase_name = params, "bench"
        self.cfg = params.train.model_copy(update={"async_checkpoint": setting, "keep_last": 1, "checkpoint_s3": None})
        self.dist = Dist(0, 1, 0, next(unet.parameters()).device)
        self.model = FullUNet(unet, self.dist)
        self.plan = SimpleNamespace(global_batch=GLOBAL_BATCH)
        parts = ("optimizer", "lr_scheduler", "ema")
        self.optim = SimpleNamespace(state_dict=lambda: {k: state[k] for k in parts}, snapshot_read=None)
        self.state = TrainState(0, 0)
        empty = np.zeros(0, np.int64)
        self.data = SimpleNamespace(sources=["bench"], source_code=empty, shard=empty, row=empty)


def next_training_step(unet, device) -> None:
    """What training does between a checkpoint and its next optimizer update: one forward and backward (batch 1,
    32×32 latents; they read the weights the background copy reads), the gradients dropped after."""
    cfg = unet.config
    latents = torch.randn(1, cfg.in_channels, 32, 32, device=device)
    text = torch.randn(1, 77, cfg.cross_attention_dim, device=device)
    out = unet(latents, torch.tensor([500], device=device), encoder_hidden_states=text).sample
    out.float().pow(2).mean().backward()
    unet.zero_grad(set_to_none=True)


def settle(optim) -> None:
    """``Optimization.settle`` on the bench's job: wait for a deferred (CPU) snapshot copy, if any."""
    wait, optim.snapshot_read = optim.snapshot_read, None
    if wait is not None:
        wait()


def measure_stall(unet, state: dict, params, run_dir: Path, rounds: int = 3) -> dict[str, float]:
    """The real checkpoint manager writing in the background (``async_checkpoint: on``). Each round times one
    training step alone, then a save followed by the same step and the wait before its optimizer update
    (``Optimization.settle``); the round's stall is the difference — on a CPU it includes the background copy's
    and write's competition for the cores. Training then goes on until the write is done: ``cost`` is how much
    longer those steps took than as many steps alone (the whole price of the checkpoint to training). The first
    round allocates the host buffers (``first_stall``); then
    ``rounds`` rounds of each copy mode alternate — ``deferred`` (the writer thread copies behind the step, the
    trainer's default) and ``inline`` (the training thread copies inside ``save``) — and each mode's stall is
    its median. Also: how long ``save()`` itself holds the caller (median) and the slowest write behind it.
    Every checkpoint verifies."""
    device = next(unet.parameters()).device
    job = _StateJob(unet, state, params, "on")
    manager = CheckpointManager(job, run_dir, "bench")
    next_training_step(unet, device)  # warm-up
    seen: dict[str, dict[str, list[float]]] = {}
    modes = ["first"] + ["inline", "deferred"] * rounds
    for step, mode in enumerate(modes, start=STEP):
        manager.defer_copy = mode != "inline"
        alone = _timed(next_training_step, unet, device)
        job.state.progress.step = step
        t0 = time.perf_counter()
        manager.save()
        hold = time.perf_counter() - t0
        next_training_step(unet, device)
        t_settle = time.perf_counter()
        settle(job.optim)
        wait = time.perf_counter() - t_settle
        stall = time.perf_counter() - t0 - alone
        steps = 1
        while manager.writer.busy:  # training goes on while the write runs: what does it cost those steps?
            next_training_step(unet, device)
            steps += 1
        total = time.perf_counter() - t0 - steps * alone
        path = manager.finish_writes()
        write = time.perf_counter() - t0  # save to written, with training running beside it
        checkpoints.verify_checkpoint(path)
        for key, value in (("alone", alone), ("stall", stall), ("cost", total), ("steps", steps), ("hold", hold),
                           ("wait", wait), ("write", write)):  # fmt: skip
            seen.setdefault(mode, {}).setdefault(key, []).append(value)
        print(f"  round {step - STEP + 1}/{len(modes)} ({mode} copy): hold {hold:.2f} s, wait {wait:.2f} s, stall "
              f"{stall:.2f} s, cost {total:.2f} s over {steps} steps of {alone:.2f} s, written in {write:.1f} s",
              flush=True)  # fmt: skip
    manager.close()
    for mode, values in seen.items():
        print(f"background, {mode} copy: " + "; ".join(f"{k} {_fmt(v)} s" for k, v in values.items()))
    med = {mode: {k: statistics.median(v) for k, v in values.items()} for mode, values in seen.items()}
    return {
        "first_stall_s": med["first"]["stall"], "stall_s": med["deferred"]["stall"], "hold_s": med["deferred"]["hold"],
        "wait_s": med["deferred"]["wait"],
        "inline_stall_s": med["inline"]["stall"], "inline_hold_s": med["inline"]["hold"],
        "cost_s": med["deferred"]["cost"], "inline_cost_s": med["inline"]["cost"],
        "step_s": statistics.median(seen["inline"]["alone"] + seen["deferred"]["alone"]),
        "async_write_s": max(max(v["write"]) for v in seen.values()), "buffers_bytes": manager.buffers.nbytes,
    }  # fmt: skip


def _fmt(values: list[float]) -> str:
    return " ".join(f"{v:.2f}" for v in values)


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def scaled_spec(spec: dict, scale: float) -> dict:
    """``spec`` with every block width × ``scale``, in multiples of 64 (32 norm groups, 8 heads)."""
    return {**spec, "block_out_channels": [max(64, round(w * scale / 64) * 64) for w in spec["block_out_channels"]]}


def parameters_of(spec: dict) -> int:
    with torch.device("meta"):
        return count_parameters(build_unet(unet_config(spec), seed=0))


def fitting_scale(spec: dict) -> float:
    """1.0 when training's state, its host copy and the next step's gradients (36 bytes per parameter: weights,
    EMA, two AdamW moments, their copy, gradients) fit in free memory, else the largest width scale, in steps
    of 0.05, that does."""
    free = memory_available() - MEMORY_MARGIN_BYTES
    for scale in [1 - 0.05 * i for i in range(15)]:
        if 36 * parameters_of(scaled_spec(spec, scale)) <= free:
            return round(scale, 2)
    return 0.3


def write_baseline(unet, state: dict, out: Path) -> dict[str, float]:
    """The plain writes (``save_pretrained`` + ``torch.save``) + ``os.sync()``, timed."""
    out.mkdir(parents=True)
    os.sync()
    t0 = time.perf_counter()
    unet.save_pretrained(out / "unet", safe_serialization=True)
    torch.save(state, out / checkpoints.STATE)
    os.sync()
    return {"baseline_s": time.perf_counter() - t0, "bytes": dir_bytes(out)}


def _remove(tmp: Path, created: list[Path]) -> None:
    """Delete the bench's temporary checkpoints and the folders it created (deepest first, if empty)."""
    shutil.rmtree(tmp, ignore_errors=True)
    for d in created:
        try:
            d.rmdir()
        except OSError:
            break


def report_stall_only(stall: dict[str, float], scale: float) -> None:
    """The ``--stall-only`` summary and RESULT line: the deferred copy (ours) against the inline copy."""
    print(f"in the background: save() holds the step {stall['hold_s']:.2f} s, its update waits "
          f"{stall['wait_s']:.2f} s, "
          f"the next step is {stall['stall_s']:.2f} s longer (step alone {stall['step_s']:.2f} s), all steps until the "
          f"write is done {stall['cost_s']:.2f} s longer; inline copy: {stall['inline_stall_s']:.2f} / "
          f"{stall['inline_hold_s']:.2f} / {stall['inline_cost_s']:.2f} s; writes take up to "
          f"{stall['async_write_s']:.1f} s")  # fmt: skip
    print(result_line(
        "checkpoint_write", stall["inline_cost_s"] / max(stall["cost_s"], 1e-3), stall_s=stall["stall_s"],
        first_stall_s=stall["first_stall_s"], hold_s=stall["hold_s"], wait_s=stall["wait_s"], cost_s=stall["cost_s"],
        inline_stall_s=stall["inline_stall_s"], inline_hold_s=stall["inline_hold_s"],
        inline_cost_s=stall["inline_cost_s"], step_s=stall["step_s"], async_write_s=stall["async_write_s"],
        scale=scale, stall_only="yes", machine=machine(),
    ))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a small UNet (seconds; timings meaningless)")
    ap.add_argument("--dir", type=Path, default=REPO / ".bench" / "checkpoint_write",
                    help="where the temporary checkpoints go (same filesystem as the runs, ideally)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (default 0: torch's own, every core, as the trainer runs)")
    ap.add_argument("--baseline-first", action="store_true", help="write the baseline before ours (order check)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the state lives (cuda: the background write copies it to pinned host memory)")
    ap.add_argument("--stall-only", action="store_true",
                    help="only the background write's stall (no blocking/baseline writes: a GPU lease is short); "
                    "ratio = the inline copy's cost ÷ the deferred copy's")
    ap.add_argument("--rounds", type=int, default=3, help="background rounds per copy mode (median)")
    ap.add_argument("--scale", default="auto", help="block-width scale of the UNet; auto: 1 when the state and a "
                    "host copy of it fit in free memory (the background write's), else the largest that does")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    params = load_params(FULL_PARAMS)
    spec = QUICK_UNET if args.quick else params.models.unet.model_dump()
    device = torch.device(args.device)
    if args.quick or (args.scale == "auto" and device.type == "cuda"):  # a GPU's state has one host copy only
        scale = 1.0
    else:
        scale = fitting_scale(spec) if args.scale == "auto" else float(args.scale)
    spec = scaled_spec(spec, scale) if scale != 1.0 else spec
    config = params.model_dump(mode="json")
    size_name = "quick" if args.quick else "full size" if scale == 1.0 else f"width scale {scale} (2 copies must fit)"
    print(f"machine: {machine()}; load average {load_average()}; {size_name}")

    t0 = time.perf_counter()
    unet, state, n_params = build_state(spec, device)
    rng = [capture_rng(torch.Generator(), device)]
    print(f"built UNet ({n_params:,} params) + AdamW + EMA in {time.perf_counter() - t0:.1f} s; "
          f"peak RSS {peak_rss_mib():.0f} MiB")  # fmt: skip
    if not args.quick and scale == 1.0 and n_params != SD1_UNET_PARAMS:
        raise SystemExit(f"full UNet has {n_params:,} parameters, expected {SD1_UNET_PARAMS:,}")

    created = [d for d in (args.dir, *args.dir.parents) if not d.exists()]  # removed again at the end, if empty
    args.dir.mkdir(parents=True, exist_ok=True)
    need = n_params * 4 * 4  # weights + EMA + exp_avg + exp_avg_sq, fp32
    free = shutil.disk_usage(args.dir).free
    print(f"free disk under {args.dir}: {free / 1e9:.1f} GB (one checkpoint ≈ {need / 1e9:.2f} GB)")
    if free < need * 1.1:
        raise SystemExit(f"not enough free disk under {args.dir}: {free / 1e9:.1f} GB < {need * 1.1 / 1e9:.1f} GB")

    tmp = Path(tempfile.mkdtemp(prefix="run-", dir=args.dir))
    if args.stall_only:
        try:
            stall = measure_stall(unet, state, params, tmp / "async", rounds=args.rounds)
        finally:
            _remove(tmp, created)
        report_stall_only(stall, scale)
        return
    try:
        if args.baseline_first:
            base = write_baseline(unet, state, tmp / "baseline")
            shutil.rmtree(tmp / "baseline")
        ours = write_ours(unet, state, rng, config, tmp / "ours")
        shutil.rmtree(tmp / "ours")
        if not args.baseline_first:
            base = write_baseline(unet, state, tmp / "baseline")
        shutil.rmtree(tmp / "baseline", ignore_errors=True)
        stall = measure_stall(unet, state, params, tmp / "async")
    finally:
        _remove(tmp, created)

    ours_s, hash_s, baseline_s = ours["ours_s"], ours["hash_s"], base["baseline_s"]
    write_s = ours_s - hash_s
    size = ours["bytes"]
    print(f"ours: {ours_s:.2f} s for {size:,} bytes in {ours['files']} files "
          f"(unet/ {ours['unet_bytes']:,}, state.pt {ours['state_bytes']:,})")  # fmt: skip
    print(f"  unet weights {ours['weights_s']:.2f} s, state.pt + rng + config {ours['state_s']:.2f} s, "
          f"sha256 manifest {hash_s:.2f} s ({size / hash_s / 1e6:.0f} MB/s), COMPLETE + rename + prune "
          f"{ours['finish_s']:.3f} s, final os.sync {ours['sync_s']:.2f} s")  # fmt: skip
    print(f"  write (everything but the hashing) {write_s:.2f} s = {size / write_s / 1e6:.0f} MB/s")
    print(f"baseline: {baseline_s:.2f} s for {base['bytes']:,} bytes ({base['bytes'] / baseline_s / 1e6:.0f} MB/s)")
    print(f"hashing share of ours: {hash_s / ours_s:.0%}; peak RSS {peak_rss_mib():.0f} MiB; "
          f"load average {load_average()}")  # fmt: skip
    print(f"in the background (async_checkpoint: on): the step after a checkpoint takes {stall['stall_s']:.2f} s "
          f"longer than the same step alone ({stall['step_s']:.2f} s; {stall['first_stall_s']:.2f} s longer the "
          f"first time, allocating {stall['buffers_bytes'] / 2**30:.2f} GiB of host buffers), save() itself holds it "
          f"{stall['hold_s']:.2f} s and its update waits {stall['wait_s']:.2f} s, all steps until the write is done "
          f"{stall['cost_s']:.2f} s longer; copying "
          f"inline instead: {stall['inline_stall_s']:.2f} / {stall['inline_hold_s']:.2f} / "
          f"{stall['inline_cost_s']:.2f} s; "
          f"blocking: {ours_s:.2f} s; the write takes up to {stall['async_write_s']:.2f} s behind training")
    print(result_line(
        "checkpoint_write", baseline_s / ours_s, ours_s=ours_s, baseline_s=baseline_s, bytes=size,
        write_s=write_s, hash_s=hash_s, stall_s=stall["stall_s"], first_stall_s=stall["first_stall_s"],
        hold_s=stall["hold_s"], wait_s=stall["wait_s"], cost_s=stall["cost_s"], inline_stall_s=stall["inline_stall_s"],
        inline_hold_s=stall["inline_hold_s"], inline_cost_s=stall["inline_cost_s"],
        step_s=stall["step_s"],
        async_write_s=stall["async_write_s"], scale=scale, fits_30s=yes_no(ours_s <= GRACE_PERIODS[0]),
        fits_120s=yes_no(ours_s <= GRACE_PERIODS[1]), machine=machine(),
    ))  # fmt: skip


if __name__ == "__main__":
    main()
