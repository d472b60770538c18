"""Chaos harness for training: kill -9, SIGTERM with and without enough grace, and world-size changes
(1 ↔ 2 ranks on gloo) inside one demo phase; checks that no checkpoint is torn and every sample is
trained exactly once per epoch.

``python -m tools.chaos_harness`` clones HEAD (committed code only), shrinks the demo with the
end-to-end profile (``tools.tiny_demo.shrink``) and gives phase 1 a two-source mix (LAION + DiffusionDB,
64 samples, 2 epochs, global batch 16: 8 steps, a checkpoint every 3, written in the background), runs
``dvc repro`` up to ``mix_phase@phase1``, then trains ``train@phase1`` through the stage CLI
(``python -m stages.train``, which launches torchrun for 2 ranks) under each *sequence* of :data:`SEQUENCES`:
attempts on a given world size, each ended by an event once the run has logged a given step —

* ``kill`` — SIGKILL to the attempt's whole process group (a pod dying; can land inside a checkpoint write);
* ``term`` — SIGTERM to the stage's process (a pod deletion; the launcher forwards it to torchrun, torchrun
  to the ranks), which must exit with status 75 after a checkpoint at the next step boundary;
* ``term-short`` — the same with ``train.preempt_grace_s`` too short for any write: exit 75, no new checkpoint;
* ``finish`` — run to the end (every sequence's last attempt).

Sequences with a world ``"2f"`` run 2 ranks with ``train.parallel: fsdp`` (sharded weights, DCP checkpoints;
issue 57) and switch to and from DDP ranks. Phase 1's post-hoc EMA is off in the harness (sharded runs refuse it).

Checks per sequence: every ``checkpoint-*`` directory under its final name carries a manifest that verifies
(0 torn); the phase's ledger (``checkpoints/phase1/ledger.parquet``) holds every planned sample of every epoch
exactly once (0 duplicated, 0 missing; recomputed here from the ledger, and the stage's own audit in its
metrics); the exit statuses are the expected ones; the final weights are bit-identical (sha256) to the
uninterrupted run of the same world size when the world never changed, and its final loss within
:data:`LOSS_TOLERANCE` of it when it did (the weights' max |Δ| reported beside the 1-vs-2-rank references').
The last line is ``RESULT name=chaos sequences=... torn=0 duplicated=0 missing=0 failed=0``. docs/RESILIENCE.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import polars as pl
import yaml
from safetensors.torch import load_file

from sdforge.latents.bucket_batches import plan_epochs
from sdforge.latents.loader import LatentIndexDataset
from sdforge.training.checkpoints import CheckpointError, verify_checkpoint
from tools.kill_attempt import dvc_env
from tools.kill_harness import _dvc, make_project
from tools.tiny_demo import free_port

PHASE = "phase1"
GLOBAL_BATCH = 16
LOSS_TOLERANCE = 1e-3
"""Relative difference of ``final_loss`` allowed vs the uninterrupted run when the world size changed. The
weights are compared too and reported, not judged: float32 summation order (an all-reduce vs accumulation)
differs, and Adam turns it into differences up to ~lr on weights whose gradients are near zero — the same
size as between the uninterrupted runs on 1 and on 2 ranks, which the report prints as the yardstick."""
EXPECTED_RC = {"kill": -signal.SIGKILL, "term": 75, "term-short": 75, "finish": 0}

SEQUENCES: list[list[tuple[int, str, int]]] = [
    [(1, "term", 3), (1, "finish", 0)],
    [(1, "kill", 2), (1, "term", 5), (1, "finish", 0)],
    [(1, "term", 2), (2, "finish", 0)],
    [(2, "kill", 3), (1, "finish", 0)],
    [(1, "term", 2), (2, "term", 4), (1, "finish", 0)],
    [(2, "term", 2), (2, "kill", 5), (2, "finish", 0)],
    [(1, "kill", 1), (2, "kill", 4), (1, "term", 6), (1, "finish", 0)],
    [(1, "term-short", 4), (1, "finish", 0)],
    [(2, "term-short", 4), (1, "finish", 0)],
    [(1, "kill", 4), (2, "term", 5), (2, "finish", 0)],
    [(2, "term", 1), (1, "kill", 3), (2, "finish", 0)],
    [(1, "term", 4), (2, "kill", 5), (1, "finish", 0)],
    [("2f", "kill", 3), ("2f", "finish", 0)],
    [("2f", "term", 2), (1, "finish", 0)],
    [(1, "kill", 2), ("2f", "term", 5), ("2f", "finish", 0)],
    [("2f", "term-short", 4), (2, "finish", 0)],
]
"""(world size, event, step after which it lands) per attempt; a world ``"2f"`` is 2 ranks with
``train.parallel: fsdp`` (issue 57: sharded checkpoints, resumed sharded or replicated), a number that many DDP
ranks."""


def _shape(world: int | str) -> tuple[int, str]:
    """``(nproc_per_node, train.parallel)`` of a sequence's world: ``2`` → (2, ddp), ``"2f"`` → (2, fsdp)."""
    if isinstance(world, str) and world.endswith("f"):
        return int(world[:-1]), "fsdp"
    return int(world), "ddp"


@dataclass
class Outcome:
    events: list[str]
    rcs: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    torn: int = 0
    duplicated: int = 0
    missing: int = 0
    max_diff: float | None = None
    loss_rel: float | None = None
    bit_identical: bool | None = None


def prepare(workdir: Path) -> Path:
    """The project: a clone with the tiny demo params, phase 1 on two sources, data up to its mix."""
    root = make_project(workdir / "project", free_port())
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["phases"][PHASE].update(mix={"laion": 0.5, "diffusiondb": 0.5}, samples=64, epochs=2, grad_accum=1)
    params["train"].update(save_steps=3, keep_last=3, async_checkpoint="on")  # background writes (issue 38)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    _dvc(root, "repro", f"mix_phase@{PHASE}")
    return root


def _edit_params(root: Path, batch: int | None = None, **train) -> None:
    """Set ``train`` keys (the job's shape and grace: they keep a run resumable) and, when starting a run, the
    per-rank batch (it fixes the run's global batch, 16)."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["train"].update(train)
    if batch is not None:
        params["phases"][PHASE]["batch_size"] = batch
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def _logged_step(root: Path) -> int:
    path = root / "runs" / PHASE / "steps.jsonl"
    if not path.is_file():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip().endswith("}")]
    return max(steps, default=0)


def attempt(root: Path, world: int, event: str, at_step: int, log) -> int:
    """One run of the stage on ``world`` ranks, ended by ``event`` once step ``at_step`` is logged."""
    nproc, parallel = _shape(world)
    grace = 1e-6 if event == "term-short" else 25.0
    _edit_params(root, nproc_per_node=nproc, parallel=parallel, preempt_grace_s=grace)
    with open(root / "chaos.log", "a") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stages.train", "--params", "params.yaml", "--item", PHASE],
            cwd=root, env=dvc_env(), stdout=out, stderr=out, start_new_session=True,
        )
        deadline = time.monotonic() + 600
        while event != "finish" and proc.poll() is None and time.monotonic() < deadline:
            if _logged_step(root) >= at_step:
                if event == "kill":
                    os.killpg(proc.pid, signal.SIGKILL)
                else:
                    proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.02)
        rc = proc.wait(timeout=max(1, deadline - time.monotonic()))
    if event == "kill":
        _reap_group(proc.pid)
    log(f"  world {world} {event}@{at_step}: exit {rc} (logged step {_logged_step(root)})")
    return rc


def _reap_group(pgid: int) -> None:
    """SIGKILL whatever is left of a killed attempt's process group (torchrun's ranks run in their own)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    out = subprocess.run(["pgrep", "-f", f"stages.train --params params.yaml --item {PHASE}"],
                         capture_output=True, text=True)
    for pid in out.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    time.sleep(1)


def torn_checkpoints(root: Path) -> int:
    """Checkpoints under their final name whose manifest is missing or does not verify."""
    torn = 0
    for ckpt in sorted((root / "runs" / PHASE).glob("checkpoint-*")):
        if not ckpt.is_dir() or "." in ckpt.name:
            continue  # temp dirs (``.tmp``) are interrupted writes, never resumed from
        try:
            verify_checkpoint(ckpt)
        except CheckpointError:
            torn += 1
    return torn


def ledger_counts(root: Path, params: dict) -> tuple[int, int]:
    """(duplicated, missing) samples over the phase's epochs, from the exported ledger and the epoch plans."""
    ledger = pl.read_parquet(root / "checkpoints" / PHASE / "ledger.parquet")
    data = LatentIndexDataset(root / params["paths"]["mixes"] / f"{PHASE}.parquet", root / params["paths"]["latents"],
                              params["phases"][PHASE]["resolution"])
    cfg = params["train"]
    duplicated = missing = 0
    plans = plan_epochs(data.sample_bucket, params["phases"][PHASE]["epochs"], cfg["seed"], GLOBAL_BATCH,
                        cfg["bucket_tail"])
    for epoch, plan in enumerate(plans):
        seen = ledger.filter(pl.col("epoch") == epoch)["position"].to_list()
        planned = {int(p) for batch in plan.batches for p in batch}
        duplicated += len(seen) - len(set(seen))
        missing += len(planned - set(seen))
    return duplicated, missing


def _weights(root: Path) -> dict:
    return {sub: load_file(root / "checkpoints" / PHASE / sub / "diffusion_pytorch_model.safetensors")
            for sub in ("unet", "unet_ema")}


def _sha(root: Path) -> str:
    h = hashlib.sha256()
    for sub in ("unet", "unet_ema"):
        h.update((root / "checkpoints" / PHASE / sub / "diffusion_pytorch_model.safetensors").read_bytes())
    return h.hexdigest()


def _reset(root: Path) -> None:
    for path in (root / "runs" / PHASE, root / "checkpoints" / PHASE):
        shutil.rmtree(path, ignore_errors=True)
    (root / "metrics" / "train" / f"{PHASE}.json").unlink(missing_ok=True)


def reference(root: Path, world: int, log) -> dict:
    """The uninterrupted run on ``world`` ranks: its weights, their sha256 and final loss."""
    _reset(root)
    _edit_params(root, batch=GLOBAL_BATCH // _shape(world)[0])
    rc = attempt(root, world, "finish", 0, log)
    if rc != 0:
        raise RuntimeError(f"the uninterrupted run on {world} rank(s) failed ({rc}); see {root / 'chaos.log'}")
    metrics = json.loads((root / "metrics" / "train" / f"{PHASE}.json").read_text())
    return {"weights": _weights(root), "sha": _sha(root), "final_loss": metrics["final_loss"]}


def run_sequence(root: Path, sequence, refs: dict, log) -> Outcome:
    _reset(root)
    _edit_params(root, batch=GLOBAL_BATCH // _shape(sequence[0][0])[0])  # the first world fixes the per-rank batch
    out = Outcome([f"w{w}:{e}@{s}" if e != "finish" else f"w{w}:finish" for w, e, s in sequence])
    for world, event, step in sequence:
        rc = attempt(root, world, event, step, log)
        out.rcs.append(rc)
        out.torn += torn_checkpoints(root)
        if rc != EXPECTED_RC[event] and not (event != "finish" and rc == 0):
            out.problems.append(f"w{world} {event}@{step}: exit {rc}, expected {EXPECTED_RC[event]}")
    if out.rcs[-1] != 0:
        out.problems.append("the last attempt did not finish")
        return out
    params = yaml.safe_load((root / "params.yaml").read_text())
    out.duplicated, out.missing = ledger_counts(root, params)
    metrics = json.loads((root / "metrics" / "train" / f"{PHASE}.json").read_text())
    if metrics["ledger.duplicates"] or metrics["ledger.missing"] or metrics["ledger.unplanned"]:
        out.problems.append(f"the stage's audit: {metrics['ledger.duplicates']} duplicated, "
                            f"{metrics['ledger.missing']} missing, {metrics['ledger.unplanned']} unplanned")
    worlds = {w for w, _, _ in sequence}
    ref = refs[sequence[0][0]]
    if len(worlds) == 1:
        out.bit_identical = _sha(root) == ref["sha"]
        if not out.bit_identical:
            out.problems.append(f"weights differ from the uninterrupted world-{sequence[0][0]} run")
    else:
        got = _weights(root)
        out.max_diff = max(float((got[s][k].double() - ref["weights"][s][k].double()).abs().max())
                           for s in got for k in got[s])
        out.loss_rel = abs(metrics["final_loss"] - ref["final_loss"]) / max(abs(ref["final_loss"]), 1e-12)
        if out.loss_rel > LOSS_TOLERANCE:
            out.problems.append(f"final loss rel. diff {out.loss_rel:.3g} > {LOSS_TOLERANCE}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=len(SEQUENCES), help="run the first N sequences")
    ap.add_argument("--start", type=int, default=0, help="skip the sequences before this index (e.g. 12: FSDP's)")
    ap.add_argument("--workdir", type=Path, help="keep the project here (default: a temp dir, deleted)")
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chaos-harness-"))
    workdir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        print(f"### preparing the demo phase in {workdir}", flush=True)
        root = prepare(workdir)
        chosen = SEQUENCES[args.start : args.sequences]
        shapes = [1, 2] + sorted({seq[0][0] for seq in chosen} - {1, 2}, key=str)
        refs = {w: reference(root, w, print) for w in shapes}
        yardstick = max(float((refs[1]["weights"][s][k].double() - refs[2]["weights"][s][k].double()).abs().max())
                        for s in refs[1]["weights"] for k in refs[1]["weights"][s])
        print(f"### references: world 1 vs world 2 max |Δ weight| {yardstick:.3g}, final loss "
              f"{refs[1]['final_loss']} vs {refs[2]['final_loss']}", flush=True)
        outcomes = []
        for i, sequence in enumerate(chosen, start=args.start):
            print(f"### sequence {i}: {sequence}", flush=True)
            out = run_sequence(root, sequence, refs, print)
            outcomes.append(out)
            print(f"    {' → '.join(out.events)}: exits {out.rcs}, torn {out.torn}, duplicated {out.duplicated}, "
                  f"missing {out.missing}, bit-identical {out.bit_identical}, max |Δ| {out.max_diff}, "
                  f"loss rel {out.loss_rel}, "
                  f"problems {out.problems or 'none'}", flush=True)
        failed = sum(bool(o.problems) for o in outcomes)
        print(f"RESULT name=chaos sequences={len(outcomes)} torn={sum(o.torn for o in outcomes)} "
              f"duplicated={sum(o.duplicated for o in outcomes)} missing={sum(o.missing for o in outcomes)} "
              f"failed={failed} seconds={time.monotonic() - start:.0f}", flush=True)
        return 0 if failed == 0 else 1
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
