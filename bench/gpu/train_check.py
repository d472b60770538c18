"""CUDA training check: the train stage trains the full-size UNet in bf16, is SIGKILLed, resumes, and continues.

``python -m bench.gpu.train_check [--quick] [--workdir DIR] [--steps N] [--batch B]``

On a workspace from :mod:`bench.gpu.workspace` (the full config's SD1.x UNet on 64×64 synthetic latents;
``--quick``: a tiny UNet on 8×8 latents, for CPU rehearsals) it runs ``python -m stages.train`` three
times, each in its own process: an uninterrupted reference; the same run SIGKILLed right after step
``kill_at`` (``SDFORGE_KILL_AT_STEP``), which lies past a checkpoint; and the rerun, which resumes from
that checkpoint. ``train.deterministic`` is on (deterministic kernels where torch has them).

Checks (the process exits 1 if any fails): every step's loss finite; the loss falls (mean of the
first tenth of the steps ÷ mean of the last tenth > 1); the rerun resumed from the checkpoint before the
kill; its loss sequence (``runs/phase1/steps.jsonl``) continues the reference's — reported as the largest
absolute difference and whether it is bit-identical; every retained checkpoint verifies; and the
exported live and EMA weights, compared tensor by tensor with the reference's.

The last line is ``RESULT name=train_check ratio=<first-tenth loss ÷ last-tenth loss> ok=... ...``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from bench._common import machine, result_line
from bench.gpu import workspace
from sdforge.training.checkpoints import CheckpointError, checkpoint_dirs, verify_checkpoint
from sdforge.training.reporting import read_steps


def plan(quick: bool, steps: int | None, batch: int | None, train: dict | None = None) -> dict:
    """Steps, batch, checkpoint interval and kill step of the check (one epoch; the kill lands between checkpoints)."""
    batch = batch or (4 if quick else 8)
    steps = steps or (40 if quick else 120)
    save = max(1, steps // 4)
    return {
        "unet": workspace.TINY_UNET if quick else workspace.full_unet(),
        "samples": batch * steps,
        # keep one checkpoint (+ the one being written): a full-size one is ~14 GB, the GPU machine has 64 GB of disk
        "train": {"save_steps": save, "keep_last": 1, "keep_best": False, "log_every": 10, "deterministic": True,
                  **(train or {})},  # fmt: skip
        "phase": {
            "epochs": 1,
            "batch_size": batch,
            "grad_accum": 1,
            "lr": 1e-3 if quick else 1e-4,
            "warmup_steps": max(1, steps // 10),
            "cfg_dropout": 0.1,
        },
        "steps": steps,
        "batch": batch,
        "kill_at": 2 * save + max(1, save // 2),
        "resume_from": 2 * save,
    }


def twin(params_file: Path, root: Path) -> Path:
    """A second params file sharing models, latents and index, with its own runs, checkpoints and metrics."""
    data = yaml.safe_load(params_file.read_text())
    scratch = Path(data["paths"]["checkpoints"]) / "scratch"
    for key in ("runs", "checkpoints", "metrics"):
        data["paths"][key] = str(root / key)
    (root / "checkpoints").mkdir(parents=True)
    (root / "checkpoints" / "scratch").symlink_to(scratch, target_is_directory=True)
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


PROGRESS_WORDS = ("step", "checkpoint", "resum", "error", "Error", "Traceback")
"""Stage log lines echoed (prefixed with the run's name) as they come, so a check cut off by a time limit still
shows how far each run got and how long its checkpoints took."""


def train(params_file: Path, log_file: Path, kill_at: int | None = None) -> tuple[int, float, str]:
    """Run the train stage on phase 1 in its own process; its return code, seconds and output (stdout + stderr)."""
    env = {**os.environ, "SDFORGE_PROGRESS": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workspace.REPO), env.get("PYTHONPATH")]))
    env.pop("SDFORGE_KILL_AT_STEP", None)
    if kill_at is not None:
        env["SDFORGE_KILL_AT_STEP"] = str(kill_at)
    cmd = [sys.executable, "-m", "stages.train", "--params", str(params_file), "--item", workspace.PHASE]
    t0 = time.perf_counter()
    lines = []
    with subprocess.Popen(
        cmd, cwd=params_file.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        for line in proc.stdout:
            lines.append(line)
            if any(word in line for word in PROGRESS_WORDS):
                print(f"  [{log_file.stem} {time.perf_counter() - t0:6.1f}s] {line.rstrip()[:200]}", flush=True)
    seconds = time.perf_counter() - t0
    output = "".join(lines)
    log_file.write_text(output)
    print(f"  [{log_file.stem}] exit {proc.returncode} after {seconds:.1f}s", flush=True)
    return proc.returncode, seconds, output


def compare_weights(a_root: Path, b_root: Path) -> dict:
    """Tensors that differ between two exported phases (live and EMA) and the largest absolute difference."""
    out = {"tensors": 0, "differ": 0, "max_abs_diff": 0.0}
    for sub in ("unet", "unet_ema"):
        rel = Path("checkpoints") / workspace.PHASE / sub / "diffusion_pytorch_model.safetensors"
        a, b = load_file(a_root / rel), load_file(b_root / rel)
        for key, tensor in a.items():
            out["tensors"] += 1
            if not torch.equal(tensor, b[key]):
                out["differ"] += 1
                diff = (tensor.double() - b[key].double()).abs().max().item()
                out["max_abs_diff"] = max(out["max_abs_diff"], diff)
    return out


def checkpoint_problems(run_dir: Path) -> list[str]:
    """Every retained checkpoint of a run dir verified against its manifest; the failures."""
    problems = []
    for ckpt in checkpoint_dirs(run_dir):
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as err:
            problems.append(f"{ckpt.name}: {err}")
    return problems


def loss_checks(ref: dict[int, dict], resumed: dict[int, dict], p: dict) -> dict:
    """Finite losses, falling loss, and how the resumed sequence continues the reference."""
    losses = [ref[s]["loss"] for s in sorted(ref)]
    tenth = max(1, len(losses) // 10)
    first, last = statistics.fmean(losses[:tenth]), statistics.fmean(losses[-tenth:])
    after = [s for s in sorted(ref) if s > p["resume_from"]]
    diffs = [abs(ref[s]["loss"] - resumed[s]["loss"]) for s in after if s in resumed]
    return {
        "steps_logged": len(losses),
        "nonfinite": sum(not math.isfinite(x) for x in losses + [r["loss"] for r in resumed.values()]),
        "loss_first": first,
        "loss_last": last,
        "fall_ratio": first / last if last > 0 else float("inf"),
        "resumed_steps": len(diffs),
        "resumed_missing": len(after) - len(diffs),
        "loss_max_abs_diff": max(diffs, default=float("nan")),
        "loss_bit_identical": len(diffs) == len(after) and all(ref[s]["loss"] == resumed[s]["loss"] for s in after),
        "img_s": p["batch"] / statistics.median(r["step_time_s"] for r in ref.values()),
    }


def run_check(root: Path, p: dict) -> dict:
    """Build, train (reference, killed, resumed), compare; every figure and check."""
    t0 = time.perf_counter()
    ref_params = workspace.build(root / "ref", p["unet"], p["samples"], p["train"], p["phase"])
    killed_params = twin(ref_params, root / "killed")
    build_s = time.perf_counter() - t0
    rc_ref, ref_s, _ = train(ref_params, root / "ref.log")
    ref_steps = read_steps(root / "ref/runs/phase1")
    ref_problems = checkpoint_problems(root / "ref/runs/phase1")
    shutil.rmtree(root / "ref/runs", ignore_errors=True)  # its exported weights stay; the disk holds one run's
    rc_died, _, _ = train(killed_params, root / "died.log", kill_at=p["kill_at"])
    rc_resumed, resumed_s, err = train(killed_params, root / "resumed.log")
    out = {
        "build_s": build_s,
        "reference_s": ref_s,
        "resumed_s": resumed_s,
        "rc_reference": rc_ref,
        "rc_killed": rc_died,
        "rc_resumed": rc_resumed,
    }
    if rc_ref != 0 or rc_resumed != 0:
        return out
    out["resumed_from_checkpoint"] = f"at step {p['resume_from']} " in err and "resumed from" in err
    out.update(loss_checks(ref_steps, read_steps(root / "killed/runs/phase1"), p))
    out["checkpoint_problems"] = len(ref_problems) + len(checkpoint_problems(root / "killed/runs/phase1"))
    weights = compare_weights(root / "ref", root / "killed")
    out.update(
        weights_differ=weights["differ"],
        weights_tensors=weights["tensors"],
        weights_max_abs_diff=weights["max_abs_diff"],
    )
    return out


def verdict(out: dict, p: dict) -> list[str]:
    """The failed checks, in words (empty: all passed)."""
    if out["rc_reference"] != 0 or out["rc_resumed"] != 0:
        return [f"train exited {out['rc_reference']} (reference) / {out['rc_resumed']} (resumed): see the logs"]
    failed = []
    if out["rc_killed"] != -9:
        failed.append(f"the killed run exited {out['rc_killed']}, not -9 (SIGKILL at step {p['kill_at']})")
    if out["steps_logged"] != p["steps"]:
        failed.append(f"{out['steps_logged']} steps logged, {p['steps']} expected")
    if out["nonfinite"]:
        failed.append(f"{out['nonfinite']} non-finite losses")
    if not out["fall_ratio"] > 1:
        failed.append(f"the loss did not fall ({out['loss_first']:.4f} -> {out['loss_last']:.4f})")
    if not out["resumed_from_checkpoint"]:
        failed.append(f"the rerun did not resume from the step-{p['resume_from']} checkpoint")
    if out["resumed_missing"]:
        failed.append(f"{out['resumed_missing']} steps after the resume missing from steps.jsonl")
    if out["checkpoint_problems"]:
        failed.append(f"{out['checkpoint_problems']} checkpoints fail verification")
    return failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny UNet, 40 steps: the CPU rehearsal (~1 min)")
    ap.add_argument("--workdir", type=Path, help="default: a temp dir, removed after")
    ap.add_argument("--steps", type=int, help="optimizer steps of the reference (default 120; quick 40)")
    ap.add_argument("--batch", type=int, help="default 8 (quick 4)")
    ap.add_argument("--train", action="append", default=[], metavar="KEY=VALUE",
                    help="a train setting (YAML value), e.g. compile=blocks or async_checkpoint=on; repeatable")
    args = ap.parse_args(argv)
    overrides = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.train)}
    p = plan(args.quick, args.steps, args.batch, overrides)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    where = machine() + (f", {torch.cuda.get_device_name()}" if device == "cuda" else "")
    print(f"machine: {where}; torch {torch.__version__}; device {device}")
    print(
        f"UNet {p['unet']['block_out_channels']} at {p['unet']['sample_size']}x{p['unet']['sample_size']} latents, "
        f"batch {p['batch']}, {p['steps']} steps, checkpoint every {p['train']['save_steps']}, kill after "
        f"step {p['kill_at']} (resume from {p['resume_from']}), deterministic kernels on; train {p['train']}"
    )
    with tempfile.TemporaryDirectory(prefix="train-check-") as tmp:
        root = args.workdir or Path(tmp)
        out = run_check(root, p)
        failed = verdict(out, p)
        for key, value in out.items():
            print(f"  {key}: {value:.6g}" if isinstance(value, float) else f"  {key}: {value}")
        for problem in failed:
            print(f"FAILED: {problem}")
        if args.workdir is None and failed:
            for name in ("ref.log", "died.log", "resumed.log"):
                if (root / name).is_file():
                    print(f"--- {name} (tail)\n" + (root / name).read_text()[-3000:])
    print(
        result_line(
            "train_check",
            out.get("fall_ratio", 0.0),
            ok=not failed,
            device=device,
            steps=p["steps"],
            batch=p["batch"],
            img_s=out.get("img_s", 0.0),
            loss_first=out.get("loss_first", float("nan")),
            loss_last=out.get("loss_last", float("nan")),
            resumed_bit_identical=out.get("loss_bit_identical", False),
            loss_max_abs_diff=out.get("loss_max_abs_diff", float("nan")),
            weights_differ=out.get("weights_differ", -1),
            machine=where,
        )
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
