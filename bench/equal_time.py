"""Benchmark: the UNet vs the MM-DiT at equal training wall time on the demo (issue 56's side by side).

``python -m bench.equal_time [--seeds N] [--quick] [--unet-params params.yaml] [--mmdit-params
.demo-mmdit/params.yaml] [--out .bench/equal_time]``

Both families train the demo's from-scratch phases, phase 0 (px24) and phase 1 (px32), on their own workspace's
encoded latents (``make demo`` and ``make demo-mmdit``, or ``dvc repro encode_latents prepare_models`` in each), in
this process, with the stages' own ``run`` functions (:mod:`bench.demo_quality`'s harness: outputs under ``--out``,
MLflow and validation images off). The same corpus, buckets, objective (flow matching), eval and probe; each
family's own model and learning rate.

**Equal time.** The MM-DiT trains the demo's steps; its training seconds (phase 0 + phase 1, the validation-loss
measurements taken out) are the budget of that train seed. The UNet, faster a step, first trains the demo's steps on
seed 0: its phase-0 seconds, phase 1's seconds outside its steps and its step seconds per epoch turn each budget
into phase 1's epochs (the cosine schedule stretched over them), and it trains those; each seed's UNet run then
calibrates the next seed's. Both runs of a seed print
their seconds: the match is as close as the calibration's.

Per run: phase 1's last validation loss (the EMA, on the phase's held-out samples at 8 fixed σ: one measurement for
both families), the probe after phase 1 (seen and held-out colour and shape), img/s (phase 1's samples ÷ its step
seconds, from the step log) and the training seconds. The last line is ``RESULT name=equal_time ratio=<median over
seeds of the UNet's validation loss ÷ the MM-DiT's at equal time: > 1, the MM-DiT ahead> ...``. ``--quick``: seed 0,
phase 0 for one epoch and phase 1 for two, no probe: a check that the harness runs, not a figure.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import time
from pathlib import Path

from bench._common import load_average, machine, result_line
from bench.demo_quality import check_inputs, seed_params, write_scratch_unet
from sdforge.config import SCRATCH, Params
from sdforge.training.reporting import read_steps
from stages import eval_grid, mix_phase, train

REPO = Path(__file__).resolve().parents[1]
PHASES = ("phase0", "phase1")
PROBE = ("colour_agreement_seen", "shape_agreement_seen", "colour_agreement_held_out", "shape_agreement_held_out")

log = logging.getLogger("bench.equal_time")


def train_run(base: Path, work: Path, seed: int, phase1_epochs: int | None, quick: bool) -> dict:
    """Phases 0-1 of ``base`` for train ``seed`` under ``work`` (phase 1 for ``phase1_epochs`` when given), then the
    probe on phase 1 unless ``quick``: seconds per phase, phase 1's validation losses, img/s and probe figures."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    overrides = [f"phases.phase1.epochs={phase1_epochs}"] if phase1_epochs else []
    if quick:
        overrides = ["phases.phase0.epochs=1", "phases.phase1.epochs=2"]
    params = seed_params(base, work, seed, False, len(PHASES), overrides)
    check_inputs(params)
    write_scratch_unet(params, Path(params.paths.checkpoints) / SCRATCH)
    result: dict = {"seed": seed, "family": params.models.denoiser.family,
                    "phase1_epochs": params.phases["phase1"].epochs}  # fmt: skip
    for name in PHASES:
        result[f"{name}_s"], result[f"{name}_steps"] = train_phase(params, name, seed)
    steps = read_steps(Path(params.paths.runs) / "phase1")
    result["val_loss"] = [record["val_loss"] for record in steps.values() if "val_loss" in record]
    step_s = sum(record.get("step_time_s", 0.0) for record in steps.values())
    result["phase1_step_s"] = step_s
    result["img_s"] = sum(record.get("samples", 0) for record in steps.values()) / step_s if step_s else float("nan")
    result["train_s"] = result["phase0_s"] + result["phase1_s"]
    if not quick:
        grid = eval_grid.run(params.eval, params.demo, Path(params.paths.models),
                             Path(params.paths.checkpoints) / "phase1", Path(params.paths.eval) / "phase1")  # fmt: skip
        result.update({key: grid.get(key) for key in PROBE})
    log.info("%s", result)
    return result


def train_phase(params: Params, name: str, seed: int) -> tuple[float, int]:
    """Mix and train phase ``name``: its training seconds (validation-loss measurements taken out) and steps."""
    index = Path(params.paths.mixes) / f"{name}.parquet"
    mix_phase.run(name, params.phases[name], Path(params.paths.latents), index, seed, params.phase_resolution(name),
                  params.train.held_out)  # fmt: skip
    start = time.perf_counter()
    metrics = train.run(params, name)
    return time.perf_counter() - start - metrics.get("val_loss_seconds", 0.0), int(metrics["steps"])


def epochs_for(budget_s: float, calibration: dict) -> int:
    """Phase 1's epochs that fill ``budget_s`` after phase 0 and phase 1's fixed cost (setup, checkpoints: its
    seconds outside the steps), at the calibration run's step seconds per phase-1 epoch."""
    per_epoch = calibration["phase1_step_s"] / calibration["phase1_epochs"]
    fixed = calibration["phase0_s"] + calibration["phase1_s"] - calibration["phase1_step_s"]
    return max(1, round((budget_s - fixed) / per_epoch))


def table(runs: list[dict]) -> list[str]:
    """Markdown rows, one per run: family, seed, phase-1 steps, training seconds, img/s, last validation loss and
    the probe figures."""
    head = "| family | seed | phase-1 steps | train s | img/s | phase-1 val loss | " + " | ".join(PROBE) + " |"
    rows = [head, "|---" * (6 + len(PROBE)) + "|"]
    for r in runs:
        probe = " | ".join("n/a" if r.get(k) is None else f"{r[k]:.3f}" for k in PROBE)
        loss = f"{r['val_loss'][-1]:.4f}" if r["val_loss"] else "n/a"
        rows.append(f"| {r['label']} | {r['seed']} | {r['phase1_steps']} | {r['train_s']:.0f} | {r['img_s']:.1f} | "
                    f"{loss} | {probe} |")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    """CLI: calibrate the UNet, train both families at equal time per seed, print the table and the RESULT line."""
    parser = argparse.ArgumentParser(prog="python -m bench.equal_time")
    parser.add_argument("--seeds", type=int, default=3, help="train seeds 0 … N-1 (default 3)")
    parser.add_argument("--quick", action="store_true", help="seed 0, a few epochs, no probe: a harness check")
    parser.add_argument("--unet-params", type=Path, default=REPO / "params.yaml")
    parser.add_argument("--mmdit-params", type=Path, default=REPO / ".demo-mmdit" / "params.yaml")
    parser.add_argument("--out", type=Path, default=REPO / ".bench" / "equal_time")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    load_before, out = load_average(), args.out.resolve()
    seeds = [0] if args.quick else list(range(args.seeds))
    calibration = {**train_run(args.unet_params, out / "unet-demo-steps", 0, None, args.quick), "label": "unet (demo)"}
    runs, ratios = [calibration], []
    for seed in seeds:
        mmdit = {**train_run(args.mmdit_params, out / f"mmdit/seed-{seed}", seed, None, args.quick), "label": "mmdit"}
        epochs = 2 if args.quick else epochs_for(mmdit["train_s"], calibration)
        unet = train_run(args.unet_params, out / f"unet/seed-{seed}", seed, epochs, args.quick)
        runs += [mmdit, {**unet, "label": "unet (equal time)"}]
        calibration = unet  # the latest UNet run calibrates the next seed's epochs (the machine's speed drifts)
        if mmdit["val_loss"] and unet["val_loss"]:
            ratios.append(unet["val_loss"][-1] / mmdit["val_loss"][-1])
    for row in table(runs):
        print(row)
    mm = [r for r in runs if r["label"] == "mmdit"]
    eq = [r for r in runs if r["label"] == "unet (equal time)"]
    print(result_line(
        "equal_time", statistics.median(ratios) if ratios else float("nan"), seeds=len(seeds), quick=args.quick,
        mmdit_train_s_median=statistics.median(r["train_s"] for r in mm),
        unet_train_s_median=statistics.median(r["train_s"] for r in eq),
        mmdit_img_s_median=statistics.median(r["img_s"] for r in mm),
        unet_img_s_median=statistics.median(r["img_s"] for r in eq),
        unet_phase1_epochs=",".join(str(r["phase1_epochs"]) for r in eq),
        load_avg=f"{load_before} -> {load_average()}", machine=machine(),
    ))  # fmt: skip


if __name__ == "__main__":
    main()
