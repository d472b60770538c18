"""What the kill harness (:mod:`tools.kill_harness`) records, checks after an episode, and reports.

The records of each kill and episode; the checks on a project's artifacts (the sha256 of the EMA and
live UNet weights and eval grids, every DVC output's md5 in ``dvc.lock``, each retained training
checkpoint against its manifest, each latent shard); and the final report with its ``RESULT`` line.
The ``dvc status`` checks run ``dvc`` and stay in :mod:`tools.kill_harness`.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sdforge.latents.store import check_shard
from sdforge.training.checkpoints import CheckpointError, checkpoint_dirs, verify_checkpoint


def stage_type(stage: str) -> str:
    """The stage name without its ``@`` item: ``train@phase1`` -> ``train``."""
    return stage.split("@")[0]


@dataclass
class Kill:
    """One kill that landed: its target, where it landed, seconds into that stage, PIDs left alive."""

    episode: int
    target: str
    landed: str
    after_s: float
    leftover: int


@dataclass
class Episode:
    """What one episode (a fresh clone run to completion through its kills) found."""

    kills: list[Kill] = field(default_factory=list)
    reruns: list[str] = field(default_factory=list)
    corrupt: list[str] = field(default_factory=list)
    hash_diff: list[str] = field(default_factory=list)
    lock_diff: list[str] = field(default_factory=list)
    attempts: int = 0
    push_repairs: list[int] = field(default_factory=list)
    """Per killed push: the extra pushes needed before the remote was complete."""


def sha256(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def result_hashes(root: Path) -> dict[str, str]:
    """sha256 of each phase's EMA (and live) safetensors and eval grid PNG."""
    out = {}
    for phase_dir in sorted((root / "checkpoints").iterdir()):
        if phase_dir.name == "scratch":
            continue
        for f in sorted(phase_dir.glob("unet*/*.safetensors")):
            out[f.relative_to(root).as_posix()] = sha256(f)
    for grid in sorted((root / "eval").glob("*/grid.png")):
        out[grid.relative_to(root).as_posix()] = sha256(grid)
    return out


def lock_outs(root: Path) -> dict[str, str]:
    """Every DVC output's md5 from ``dvc.lock``, except those that hold timings: the metrics JSONs and the report
    page (its table shows each phase's train seconds and samples/s; the figures it draws from are compared as
    metrics-free outputs and grids)."""
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    outs = {}
    for name, stage in lock["stages"].items():
        for out in stage.get("outs", []):
            if not out["path"].startswith("metrics/") and not out["path"].endswith("report.html"):
                outs[f"{name}:{out['path']}"] = out["md5"]
    return outs


def differing_keys(reference: dict[str, str], got: dict[str, str]) -> list[str]:
    """The keys, sorted, whose value differs between the two (missing on one side counts as differing)."""
    return sorted(k for k in reference.keys() | got.keys() if reference.get(k) != got.get(k))


def checkpoint_problems(root: Path) -> list[str]:
    """One line per retained ``runs/<phase>/checkpoint-*`` that fails its manifest."""
    problems = []
    for run_dir in sorted((root / "runs").glob("*")):
        for ckpt in checkpoint_dirs(run_dir):
            try:
                verify_checkpoint(ckpt)
            except CheckpointError as err:
                problems.append(str(err))
    return problems


def shard_problems(root: Path) -> list[str]:
    """One line per latent shard under ``data/latents`` that fails ``check_shard``."""
    problems = []
    for src in sorted((root / "data/latents").glob("*")):
        for part in sorted(src.glob("shard-*.parquet")):
            try:
                check_shard(src, int(part.stem.split("-")[1]))
            except Exception as err:  # noqa: BLE001 - any failure is a corrupt shard
                problems.append(f"{part}: {err}")
    return problems


def summarize(episodes: list[Episode], seconds: float) -> tuple[str, bool]:
    """The report (a row per kill, the findings, the ``RESULT`` line) and whether every check passed."""
    kills = [k for ep in episodes for k in ep.kills]
    rows = ["episode  target          landed in                       after_s  leftover_pids"]
    rows += [f"{k.episode:>7}  {k.target:<14}  {k.landed:<30}  {k.after_s:>7}  {k.leftover:>13}" for k in kills]
    by_stage = collections.Counter(
        stage_type(k.landed.split("+")[0]) + ("+ckpt" if "+ckpt" in k.landed else "") for k in kills
    )
    reruns = [r for ep in episodes for r in ep.reruns]
    corrupt = [c for ep in episodes for c in ep.corrupt]
    hash_diff = [d for ep in episodes for d in ep.hash_diff]
    lock_diff = sorted({d for ep in episodes for d in ep.lock_diff})
    leftover = sum(k.leftover for k in kills)
    rows.append("")
    rows.append(
        f"episodes: {len(episodes)}, dvc repro attempts: {sum(ep.attempts for ep in episodes)}, "
        f"wall time {seconds:.0f} s"
    )
    rows.append(f"landed by stage: {dict(sorted(by_stage.items()))}")
    rows.append(f"completed stages rerun: {reruns or 'none'}")
    rows.append(f"corrupt artifacts: {corrupt or 'none'}")
    rows.append(f"EMA/grid hashes differing from the uninterrupted run: {hash_diff or 'none'}")
    rows.append(f"other DVC outputs differing (dvc.lock md5): {lock_diff or 'none'}")
    repairs = [r for ep in episodes for r in ep.push_repairs]
    rows.append(
        f"killed pushes whose next push left the remote incomplete (a 2nd push fixed it): "
        f"{sum(1 for r in repairs if r)} of {len(repairs)}"
    )
    ok = not reruns and not corrupt and not hash_diff and leftover == 0
    landed = ",".join(f"{k}:{v}" for k, v in sorted(by_stage.items()))
    rows.append(
        f"RESULT kills={len(kills)} landed={landed} corrupt={len(corrupt)} reruns={len(reruns)} "
        f"leftover_pids={leftover} hash_equal={str(not hash_diff).lower()} "
        f"outs_equal={str(not lock_diff).lower()} ok={str(ok).lower()}"
    )
    return "\n".join(rows), ok
