"""Training checkpoints: atomic directory writes, retention, safe loading, newest-good discovery.

Layout of one checkpoint ``<run_dir>/checkpoint-<step:08d>/``:
- ``unet/`` — live weights (``save_pretrained``, safetensors);
- ``state.pt`` — optimizer, LR scheduler, EMA (shadow params), RNG states, step/epoch/batch;
  loaded with ``torch.load(weights_only=True)`` (no arbitrary unpickling);
- ``COMPLETE`` — written last; a directory without it is an interrupted write.
A checkpoint is written under a temp name and renamed, so a kill never leaves a half one
under the final name.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

PREFIX = "checkpoint-"
COMPLETE = "COMPLETE"
STATE = "state.pt"


@dataclass
class Progress:
    """Where training is: optimizer steps done, current epoch, next batch within the epoch."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints in ``run_dir``, oldest first."""
    if not run_dir.is_dir():
        return []
    dirs = [p for p in run_dir.glob(f"{PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp")]
    return sorted((p for p in dirs if (p / COMPLETE).is_file()), key=lambda p: p.name)


def save_checkpoint(run_dir: Path, progress: Progress, unet: Any, state: dict[str, Any], keep_last: int) -> Path:
    """Write a checkpoint atomically (temp dir + rename) and prune to the newest ``keep_last``."""
    final = run_dir / f"{PREFIX}{progress.step:08d}"
    tmp = run_dir / f"{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    unet.save_pretrained(tmp / "unet", safe_serialization=True)
    torch.save({**state, "progress": vars(progress).copy()}, tmp / STATE)
    (tmp / COMPLETE).write_text(f"{progress.step}\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    for old in checkpoint_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint %s (epoch %d, batch %d)", final, progress.epoch, progress.batch)
    return final


def load_state(ckpt: Path) -> dict[str, Any]:
    """Load ``state.pt`` of a checkpoint with ``weights_only=True``."""
    return torch.load(ckpt / STATE, map_location="cpu", weights_only=True)


def newest_loadable(run_dir: Path, load: Any) -> tuple[Path, Any] | None:
    """The newest checkpoint that ``load(path)`` accepts; corrupt ones are skipped with a warning."""
    for ckpt in reversed(checkpoint_dirs(run_dir)):
        try:
            return ckpt, load(ckpt)
        except Exception as err:  # noqa: BLE001 - any failure to read means "not a good checkpoint"
            log.warning("checkpoint %s is unreadable (%s); falling back to the previous one", ckpt, err)
    return None
