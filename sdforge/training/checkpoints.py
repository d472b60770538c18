"""Training checkpoints: atomic directory writes, a verified manifest, retention, newest-good discovery.

Layout of one checkpoint ``<run_dir>/checkpoint-<step:08d>/``:
- ``unet/`` — live weights (``save_pretrained``, safetensors); an adapter phase writes ``adapter/`` instead
  (the trained tensors only: :meth:`sdforge.training.trained_model.AdapterUNet.write_live`);
- ``state.pt`` — optimizer, LR scheduler, EMA (shadow params), progress (step/epoch/batch), loss, global batch;
- ``rng-rank<k>.pt`` — one per rank: python ``random``, numpy, torch CPU/CUDA and the rank's generator;
- ``config.json`` — the resolved params the run was started with;
- ``COMPLETE`` — written last: a JSON manifest (step, epoch, batch, loss, world, global batch, fingerprint,
  the sample-ledger segments that cover steps 1…step (:mod:`sdforge.training.ledger`, kept in the run dir's
  ``ledger/``, not in the checkpoint), and the size + sha256 of every other file). A directory without it is
  an interrupted write; a file whose size or hash differs from the manifest (truncated, corrupted, missing)
  makes the checkpoint bad.
``.pt`` files are read with ``torch.load(weights_only=True)``: no arbitrary unpickling.
A checkpoint is written under a temp name and renamed (``os.replace``), so a kill never leaves a half
one under the final name. Retention (:func:`retained`): the newest ``keep_last`` ∪ every step that is a
multiple of ``keep_every`` ∪ the lowest loss (``keep_best``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from sdforge.io import naming_write_faults

log = logging.getLogger(__name__)

PREFIX = "checkpoint-"
COMPLETE = "COMPLETE"
STATE = "state.pt"
POSTHOC_DIR = "posthoc"
"""In a run dir: the post-hoc EMA's snapshots ``step-NNNNNNNN.safetensors`` (:mod:`sdforge.training.posthoc`),
uploaded with the checkpoints to ``train.checkpoint_s3`` and fetched back on a resume from there."""
CONFIG = "config.json"
FORMAT = 3
"""3: ``batch`` counts optimizer steps in the epoch (2: micro-batches), the global batch is recorded."""


WRITE_FAULT_KEPT = "the previous checkpoint (if any) is intact: a rerun resumes from it"
"""What a checkpoint write that failed (full disk, file-size limit, …) left: the temp folder is never renamed."""


class CheckpointError(Exception):
    """A checkpoint that must not be resumed from (incomplete, corrupt, or from another job shape)."""


@dataclass
class Progress:
    """Where training is: optimizer steps done, current epoch, next batch within the epoch."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


@dataclass(frozen=True)
class Retention:
    """Which checkpoints survive pruning: newest ``keep_last`` ∪ multiples of ``keep_every`` ∪ best loss."""

    keep_last: int = 2
    keep_every: int = 0
    keep_best: bool = False


def retained(losses: dict[int, float | None], rule: Retention) -> set[int]:
    """The steps to keep out of ``{step: mean loss since the previous checkpoint}``.

    Best = lowest finite loss, the earliest step on a tie; a checkpoint without a loss is never "best".
    """
    steps = sorted(losses)
    keep = set(steps[-rule.keep_last :]) if rule.keep_last > 0 else set()
    if rule.keep_every:
        keep |= {s for s in steps if s % rule.keep_every == 0}
    scored = [(v, s) for s, v in losses.items() if v is not None and math.isfinite(v)]
    if rule.keep_best and scored:
        keep.add(min(scored)[1])
    return keep


def rng_path(ckpt: Path, rank: int) -> Path:
    return ckpt / f"rng-rank{rank}.pt"


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Checkpoints in ``run_dir`` that carry a ``COMPLETE`` marker (not yet verified), oldest first."""
    if not run_dir.is_dir():
        return []
    dirs = [p for p in run_dir.glob(f"{PREFIX}*") if p.is_dir() and "." not in p.name]
    return sorted((p for p in dirs if (p / COMPLETE).is_file()), key=lambda p: p.name)


# -- RNG -------------------------------------------------------------------------------------
def capture_rng(generator: torch.Generator, device: torch.device) -> dict[str, Any]:
    """This process's RNG states in ``weights_only``-loadable types (tensors, ints, tuples)."""
    np_state = np.random.get_state(legacy=False)
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy_key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
        "numpy_pos": int(np_state["state"]["pos"]),
        "numpy_gauss": (int(np_state["has_gauss"]), float(np_state["gauss"])),
        "torch": torch.get_rng_state(),
        "generator": generator.get_state(),
    }
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    return rng


def restore_rng(rng: dict[str, Any], generator: torch.Generator, device: torch.device) -> None:
    """Inverse of :func:`capture_rng`."""
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    has_gauss, cached = rng["numpy_gauss"]
    key = rng["numpy_key"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", key, rng["numpy_pos"], has_gauss, cached))
    torch.set_rng_state(rng["torch"])
    generator.set_state(rng["generator"])
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], device)


# -- manifest --------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _file_table(ckpt: Path) -> dict[str, dict[str, Any]]:
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != COMPLETE)
    return {p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}


def read_manifest(ckpt: Path) -> dict[str, Any]:
    """The ``COMPLETE`` manifest, parsed (no file checks); a CheckpointError if absent or not one."""
    try:
        manifest = json.loads((ckpt / COMPLETE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{ckpt}: no readable {COMPLETE} manifest ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or "files" not in manifest:
        raise CheckpointError(f"{ckpt}: {COMPLETE} is not a format-{FORMAT} manifest (older or foreign checkpoint)")
    return manifest


def verify_checkpoint(ckpt: Path) -> dict[str, Any]:
    """Check every file of the manifest (present, size, sha256); return the manifest or raise CheckpointError."""
    manifest = read_manifest(ckpt)
    for rel, want in manifest["files"].items():
        path = ckpt / rel
        if not path.is_file():
            raise CheckpointError(f"{ckpt}: {rel} is missing")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"{ckpt}: {rel} has {size} bytes, the manifest says {want['size']} (truncated?)")
        if _sha256(path) != want["sha256"]:
            raise CheckpointError(f"{ckpt}: {rel} does not match its sha256 in the manifest (corrupt)")
    return manifest


# -- save / prune / load -----------------------------------------------------------------------
def save_checkpoint(
    run_dir: Path,
    progress: Progress,
    write_weights: Callable[[Path], None],
    state: dict[str, Any],
    retention: Retention,
    *,
    rng: list[dict[str, Any]] | None = None,
    loss: float | None = None,
    config: dict[str, Any] | None = None,
    ledger: list[dict[str, Any]] | None = None,
) -> Path:
    """Write a checkpoint atomically (temp dir, manifest last, ``os.replace``), then prune by ``retention``.

    ``write_weights(folder)`` writes the live weights into the checkpoint's (temporary) folder. ``rng`` holds
    one RNG state per rank (index = rank; its length is the world size); ``loss`` is the
    mean training loss since the previous checkpoint (for ``keep_best``); ``ledger`` lists the ledger
    segments (name, rows, sha256) that cover steps 1…``progress.step``.
    """
    rng = rng or []
    final = run_dir / checkpoint_name(progress.step)
    tmp = run_dir / f"{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    with naming_write_faults(tmp, "the checkpoint", setting="paths.runs", kept=WRITE_FAULT_KEPT):
        tmp.mkdir(parents=True)
        write_weights(tmp)
        save_tensors({**state, "progress": vars(progress).copy(), "loss": loss}, tmp / STATE)
        for rank, rank_rng in enumerate(rng):
            save_tensors(rank_rng, rng_path(tmp, rank))
        (tmp / CONFIG).write_text(json.dumps(config or {}, indent=1, sort_keys=True, default=str) + "\n")
        stamp = run_dir / "fingerprint.txt"
        manifest = {
            "format": FORMAT,
            **vars(progress),
            "loss": loss,
            "world": len(rng),
            "global_batch": state.get("global_batch"),
            "ledger": ledger or [],
            "fingerprint": stamp.read_text().strip() if stamp.is_file() else None,
            "files": _file_table(tmp),
        }
        (tmp / COMPLETE).write_text(json.dumps(manifest, indent=1) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    prune(run_dir, retention)
    log.info("checkpoint %s (epoch %d, batch %d, loss %s)", final, progress.epoch, progress.batch, loss)
    return final


def save_tensors(obj: Any, path: Path) -> None:
    """``torch.save`` through a Python file, so that a write fault keeps its errno: by path, torch's zip writer
    reports a full disk or a file-size limit only as ``basic_ios::clear: iostream error``. A fault is an
    :class:`~sdforge.io.OutputError` naming ``path`` (``docs/RESILIENCE.md``, Write faults)."""
    with naming_write_faults(path, "a checkpoint file", setting="paths.runs", kept=WRITE_FAULT_KEPT):
        with open(path, "wb") as fh:
            torch.save(obj, fh)


def prune(run_dir: Path, retention: Retention) -> list[Path]:
    """Delete the checkpoints that :func:`retained` drops (unreadable manifests count as loss-less)."""
    dirs = {int(p.name.removeprefix(PREFIX)): p for p in checkpoint_dirs(run_dir)}
    losses: dict[int, float | None] = {}
    for step, path in dirs.items():
        try:
            losses[step] = read_manifest(path).get("loss")
        except CheckpointError:
            losses[step] = None
    keep = retained(losses, retention)
    dropped = [dirs[s] for s in sorted(dirs) if s not in keep]
    for old in dropped:
        (old / COMPLETE).unlink(missing_ok=True)  # marker first: a half-deleted one is never "complete"
        shutil.rmtree(old, ignore_errors=True)
    return dropped


def load_state(ckpt: Path, rank: int = 0, world: int = 1, verify: bool = True) -> dict[str, Any]:
    """``state.pt`` + an RNG state (as ``state["rng"]``), after checking the manifest when ``verify``.

    ``state["world"]`` is the world size that wrote it. At the same world size the RNG is this rank's own
    (resume is bit-exact); on another one it is rank 0's, whose shared sample generator every rank continues
    (the per-rank streams are then re-derived: :func:`sdforge.training.distributed.derive_rank_rng`).
    A missing RNG file is a CheckpointError naming it.
    """
    manifest = verify_checkpoint(ckpt) if verify else read_manifest(ckpt)
    source = rank if manifest["world"] == world else 0
    if not rng_path(ckpt, source).is_file():
        raise CheckpointError(f"{ckpt}: no {rng_path(ckpt, source).name} for rank {rank}")
    state = torch.load(ckpt / STATE, map_location="cpu", weights_only=True)
    state["rng"] = torch.load(rng_path(ckpt, source), map_location="cpu", weights_only=True)
    state["world"] = manifest["world"]
    state["ledger"] = manifest.get("ledger", [])
    if verify:
        for weights in ckpt.rglob("*.safetensors"):
            with safe_open(weights, "pt"):  # header parses
                pass
    return state


def newest_loadable(run_dir: Path, load: Callable[[Path], Any]) -> tuple[Path, Any] | None:
    """The newest checkpoint that ``load(path)`` accepts; bad ones are skipped with a warning."""
    for ckpt in reversed(checkpoint_dirs(run_dir)):
        try:
            return ckpt, load(ckpt)
        except Exception as err:  # noqa: BLE001 - any failure to read means "not a good checkpoint"
            log.warning("checkpoint %s is unreadable (%s); falling back to the previous one", ckpt, err)
    return None
