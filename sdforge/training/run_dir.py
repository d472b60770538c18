"""A phase's run dir, ``${paths.runs}/<phase>/``: resumed when it holds a run from the same inputs, otherwise moved
aside — never deleted.

A run dir from other inputs (:mod:`sdforge.training.inputs`: another weight-changing key, index, init, models
or latents) goes to ``${paths.runs}/<phase>.stale-<its fingerprint>/`` with ``STALE.json`` naming the keys and
files that differ; the stage log and metrics say so, and the disk the stale runs take is reported. Removing
them is the user's call: ``sdforge runs list`` / ``sdforge runs clean``. The run dir also records the global
batch the run started with (:func:`keep_global_batch`).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sdforge.io import write_json
from sdforge.training.distributed import broadcast_object
from sdforge.training.exits import clear_markers
from sdforge.training.inputs import RECLASSIFIED, InputRecord
from sdforge.training.s3_checkpoints import run_url

log = logging.getLogger(__name__)

STAMP = "fingerprint.txt"
"""The run's input fingerprint (also copied into every checkpoint's manifest)."""
INPUTS = "inputs.json"
"""The run's :class:`InputRecord`: every weight-changing param value and input file digest."""
STALE_MARK = ".stale-"
STALE_NOTE = "STALE.json"
RUN_GLOBAL_BATCH = "global_batch.json"
"""The global batch the run started with: a run resumed with no checkpoint yet (killed before its first) on
another world size keeps it, as one resumed from a checkpoint does."""


@dataclass(frozen=True)
class StaleRun:
    """A run dir moved aside: where it is now, its phase and its size."""

    path: Path
    phase: str
    bytes: int


def open_run_dir(
    runs: Path, phase: str, inputs: InputRecord, is_main: bool, checkpoint_s3: str | None = None
) -> tuple[Path, Path | None]:
    """The phase's run dir for ``inputs`` (main rank prepares it; every rank waits): the same run's dir is kept,
    another's is moved aside (its note names its remote copies under ``checkpoint_s3``, which stay where they
    are). Returns the run dir and where a stale one went (None if none did)."""
    run_dir = Path(runs) / phase
    moved = None
    if is_main:
        moved = _set_aside_if_stale(run_dir, inputs, checkpoint_s3)
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json(run_dir / INPUTS, inputs.to_json())
        (run_dir / STAMP).write_text(inputs.fingerprint + "\n")
        clear_markers(run_dir)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return run_dir, moved


def _set_aside_if_stale(run_dir: Path, inputs: InputRecord, checkpoint_s3: str | None) -> Path | None:
    """Move ``run_dir`` aside unless it is empty or stamped with ``inputs``' fingerprint; where it went."""
    if not run_dir.is_dir() or not any(run_dir.iterdir()):
        return None
    stamp = run_dir / STAMP
    old = stamp.read_text().strip() if stamp.is_file() else "unstamped"
    if old == inputs.fingerprint:
        return None
    why = _what_differs(run_dir, inputs)
    if set(why) <= RECLASSIFIED:  # recorded by an older sdforge with keys that no longer change the weights
        log.info("%s: recorded with %s, which no longer change the weights: the same run, restamped", run_dir,
                 ", ".join(why))  # fmt: skip
        return None
    target = _free_name(run_dir.with_name(f"{run_dir.name}{STALE_MARK}{old}"))
    run_dir.rename(target)
    remote = run_url(checkpoint_s3, run_dir.name, old) if checkpoint_s3 else None
    note = {"moved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "from": str(run_dir), "fingerprint": old,
            "new_fingerprint": inputs.fingerprint, "differs": why, "remote": remote}  # fmt: skip
    write_json(target / STALE_NOTE, note)
    log.warning(
        "%s holds a run from other inputs (%s): moved aside to %s, nothing deleted; this phase starts afresh. "
        "`sdforge runs list` shows stale runs and their size, `sdforge runs clean` removes them.",
        run_dir, ", ".join(why), target,
    )  # fmt: skip
    return target


def _free_name(path: Path) -> Path:
    """``path``, or ``path-2``, ``path-3``… if taken (the same stale inputs moved aside twice)."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _what_differs(run_dir: Path, inputs: InputRecord) -> list[str]:
    """The keys and files whose values differ from the run's recorded inputs (or why that is unknown)."""
    try:
        stored = json.loads((run_dir / INPUTS).read_text())
    except (OSError, ValueError):
        return ["unknown: the run dir has no readable inputs.json (written by an older sdforge?)"]
    return inputs.differences(stored) or ["the fingerprint scheme"]


def stale_runs(runs: Path, phase: str | None = None) -> list[StaleRun]:
    """The run dirs moved aside under ``runs`` (of ``phase`` only, if given), with their size in bytes."""
    if not Path(runs).is_dir():
        return []
    found = []
    for path in sorted(Path(runs).iterdir()):
        name, mark, _ = path.name.partition(STALE_MARK)
        if mark and path.is_dir() and (phase is None or name == phase):
            found.append(StaleRun(path, name, sum(f.stat().st_size for f in path.rglob("*") if f.is_file())))
    return found


def stale_metrics(runs: Path) -> dict:
    """``run_dir.stale_runs`` and ``run_dir.stale_bytes`` over every phase (what ``sdforge runs clean`` frees)."""
    found = stale_runs(runs)
    return {"run_dir.stale_runs": len(found), "run_dir.stale_bytes": sum(s.bytes for s in found)}


def remove_stale(runs: Path, phase: str | None = None) -> list[StaleRun]:
    """Delete the stale run dirs (of ``phase``, or all): the user's explicit call, never a stage's."""
    removed = stale_runs(runs, phase)
    for stale in removed:
        shutil.rmtree(stale.path)
        log.info("removed %s (%.1f MB)", stale.path, stale.bytes / 1e6)
    return removed


def keep_global_batch(job, run_dir: Path, restored: bool) -> None:
    """Fix the run's global batch at its first start: without a checkpoint, take the one recorded in the run dir
    (rank 0's, broadcast); record it (main rank); then refuse a plan without steps (:meth:`TrainJob.check_plan`)."""
    path = run_dir / RUN_GLOBAL_BATCH
    saved = None
    if job.dist.is_main and not restored and path.is_file():
        saved = json.loads(path.read_text()).get("global_batch")
    saved = broadcast_object(saved, job.dist.world)
    if isinstance(saved, int) and saved != job.plan.global_batch:
        log.info("run %s started with global batch %d: keeping it on %d rank(s)", run_dir, saved, job.dist.world)
        job.set_global_batch(saved)
    if job.dist.is_main:
        write_json(run_dir / RUN_GLOBAL_BATCH, {"global_batch": job.plan.global_batch})
    job.check_plan()
