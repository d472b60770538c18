"""Where a run resumes: the newest good checkpoint on local disk or under ``train.checkpoint_s3``.

Kept apart from :mod:`sdforge.training.checkpoints` (the local format) because it needs both that
module and :mod:`sdforge.training.s3_checkpoints`, which itself builds on the local format.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from sdforge.training import s3_checkpoints
from sdforge.training.checkpoints import PREFIX, CheckpointError, checkpoint_dirs, load_state

log = logging.getLogger(__name__)


def resume_point(
    run_dir: Path,
    *,
    rank: int = 0,
    world: int = 1,
    s3_url: str | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from and this rank's state, or ``None`` to start afresh.

    Rank 0 picks the newest good checkpoint of local disk and (if ``s3_url``, the ``train.checkpoint_s3``
    base) ``<s3_url>/<run dir name>/`` — by step, local on a
    tie; a remote one is downloaded into ``run_dir`` and verified first — and broadcasts its name; every
    other rank then loads that one (without re-hashing). Bad candidates are skipped with a warning.
    """
    found: tuple[Path, dict[str, Any]] | None = None
    if rank == 0:
        found = _pick(run_dir, world, s3_url)
    name = found[0].name if found else None
    if world > 1 and torch.distributed.is_initialized():
        box = [name]
        torch.distributed.broadcast_object_list(box, src=0)
        name = box[0]
    if name is None:
        return None
    if found is None:
        found = run_dir / name, load_state(run_dir / name, rank, world, verify=False)
    return found


def _pick(run_dir: Path, world: int, s3_url: str | None) -> tuple[Path, dict[str, Any]] | None:
    candidates: list[tuple[int, int, Any]] = [
        (int(p.name.removeprefix(PREFIX)), 1, p) for p in checkpoint_dirs(run_dir)
    ]
    remote = None
    if s3_url:
        remote = s3_checkpoints.RemoteRun(s3_checkpoints.run_url(s3_url, run_dir))
        candidates += [(r.step, 0, r) for r in remote.complete()]
    stamp = run_dir / "fingerprint.txt"
    fingerprint = stamp.read_text().strip() if stamp.is_file() else None
    for step, is_local, cand in sorted(candidates, key=lambda c: c[:2], reverse=True):
        try:
            if is_local:
                return cand, load_state(cand, 0, world)
            if fingerprint and cand.manifest.get("fingerprint") != fingerprint:
                raise CheckpointError(f"{cand.url}: from a run with other inputs (fingerprint differs)")
            local = remote.download(cand, run_dir)
            log.info("resuming from %s (step %d, newer than any local checkpoint)", cand.url, step)
            return local, load_state(local, 0, world)
        except Exception as err:  # noqa: BLE001 - any failure to read means "not a good checkpoint"
            where = cand if is_local else cand.url
            log.warning("checkpoint %s is unreadable (%s); falling back to the previous one", where, err)
    return None
