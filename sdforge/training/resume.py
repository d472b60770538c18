"""Where a run resumes: the newest good checkpoint on local disk or under ``train.checkpoint_s3``.

Kept apart from :mod:`sdforge.training.checkpoints` (the local format) because it needs both that
module and :mod:`sdforge.training.s3_checkpoints`, which itself builds on the local format.

:func:`restore_newest` is what the train stage uses: a checkpoint counts as good only once it has been
restored *in full* (state, RNG, UNet, EMA) on every rank; any that fails is skipped with a warning naming
the file, for the next older one. :func:`resume_point` only reads the state (no restore).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from sdforge.io import InputError, load_failure
from sdforge.training import s3_checkpoints
from sdforge.training.checkpoints import PREFIX, STATE, CheckpointError, checkpoint_dirs, load_state, rng_path
from sdforge.training.elastic import SplitError

log = logging.getLogger(__name__)

Restore = Callable[[Path, dict[str, Any]], None]
"""Restores a trainer from ``(checkpoint dir, this rank's state)`` in full, or raises."""


class ResumeError(InputError):
    """Checkpoints exist but none of them restores: the stage fails rather than train from scratch over them."""


def resume_point(
    run_dir: Path,
    *,
    rank: int = 0,
    world: int = 1,
    remote: str | None = None,
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from and this rank's state, or ``None`` to start afresh.

    Rank 0 picks the newest good checkpoint of local disk and (if ``remote``, the run's folder under
    ``train.checkpoint_s3``: :func:`sdforge.training.s3_checkpoints.run_url`) — by step, local on a
    tie; a remote one is downloaded into ``run_dir`` and verified first — and broadcasts its name; every
    other rank then loads that one (without re-hashing). Bad candidates are skipped with a warning.
    Only the state is read: :func:`restore_newest` also falls back when the restore itself fails.
    """
    found: tuple[Path, dict[str, Any]] | None = None
    if rank == 0:
        found = next(_loadable(run_dir, world, remote, []), None)
    name = _broadcast(found[0].name if found else None, world)
    if name is None:
        return None
    if found is None:
        found = run_dir / name, load_state(run_dir / name, rank, world, verify=False)
    return found


def restore_newest(
    run_dir: Path,
    restore: Restore,
    *,
    rank: int = 0,
    world: int = 1,
    remote: str | None = None,
) -> Path | None:
    """Restore the newest checkpoint that restores in full on every rank; its path, or ``None`` if there is none.

    Candidates as in :func:`resume_point`, newest first. Rank 0 loads and ``restore``s each until one
    succeeds and broadcasts its name; the other ranks restore that one and report back; a failure on any
    rank rejects it for every rank (all stay on the same checkpoint). A failure is logged as a warning
    naming the file. If checkpoints exist but none restores, every rank raises :class:`ResumeError`; a run
    that cannot continue on this job at all (:class:`~sdforge.training.elastic.SplitError`: its global batch
    does not split over this world size) raises that on every rank, whatever the checkpoint.
    """
    rejected: list[str] = []  # rank 0: names (or URLs) of the candidates that failed
    candidates = _loadable(run_dir, world, remote, rejected) if rank == 0 else iter(())
    while True:
        fatal = None
        try:
            found = _restore_first(candidates, restore, rejected) if rank == 0 else None
        except SplitError as err:
            found, fatal = None, str(err)
        name, bad, fatal = _broadcast((found.name if found else None, rejected, fatal), world)
        if fatal:
            raise SplitError(fatal)
        if name is None:
            break
        error = None if rank == 0 else _restore_named(run_dir / name, restore, rank, world)
        errors = _gather(error, world)
        if not any(errors):
            return run_dir / name
        if rank == 0:
            failed = next(e for e in errors if e)
            log.warning("checkpoint %s is unreadable (%s); falling back to the previous one", run_dir / name, failed)
            rejected.append(name)
    if bad:
        raise ResumeError(
            f"{run_dir}: none of its checkpoints can be resumed from ({', '.join(bad)}; why is logged above). "
            "Delete them (and their copies under train.checkpoint_s3) to train this phase from the start, "
            "or restore a good copy."
        )
    return None


def _restore_first(candidates: Iterator, restore: Restore, rejected: list[str]) -> Path | None:
    """Rank 0: the first of ``candidates`` that ``restore`` accepts; the others are warned about and rejected."""
    for ckpt, state in candidates:
        try:
            restore(ckpt, state)
            return ckpt
        except SplitError:
            raise
        except Exception as err:  # noqa: BLE001 - any failure to restore means "not a good checkpoint"
            log.warning(
                "checkpoint %s is unreadable (%s); falling back to the previous one", ckpt, _failure(ckpt, 0, err)
            )
            rejected.append(ckpt.name)
    return None


def _restore_named(ckpt: Path, restore: Restore, rank: int, world: int) -> str | None:
    """A non-zero rank: restore the checkpoint rank 0 chose; ``None`` on success, else why (naming the file)."""
    try:
        restore(ckpt, load_state(ckpt, rank, world, verify=False))
        return None
    except Exception as err:  # noqa: BLE001 - reported to rank 0, which falls back for every rank
        return f"on rank {rank}: {_failure(ckpt, rank, err)}"


def _failure(ckpt: Path, rank: int, err: BaseException) -> str:
    """``load_failure``, naming the ``.pt`` file that failed to unpickle (torch's message does not)."""
    why = load_failure(err)
    if not isinstance(err, pickle.UnpicklingError):
        return why
    try:
        torch.load(rng_path(ckpt, rank), map_location="cpu", weights_only=True)
        culprit = ckpt / STATE
    except Exception:  # noqa: BLE001 - then the small RNG file is the one
        culprit = rng_path(ckpt, rank)
    return f"{culprit}: {why}"


def _broadcast(value: Any, world: int) -> Any:
    """Rank 0's ``value`` on every rank (as is on one process)."""
    if world > 1 and torch.distributed.is_initialized():
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]
    return value


def _gather(value: Any, world: int) -> list[Any]:
    """Every rank's ``value``, by rank (``[value]`` on one process)."""
    if world > 1 and torch.distributed.is_initialized():
        out: list[Any] = [None] * world
        torch.distributed.all_gather_object(out, value)
        return out
    return [value]


def _loadable(
    run_dir: Path, world: int, remote_url: str | None, rejected: list[str]
) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Rank 0: each candidate whose manifest, files and state load, newest first, with rank 0's state.

    Those that do not are skipped with a warning and their names appended to ``rejected``.
    """
    candidates: list[tuple[int, int, Any]] = [
        (int(p.name.removeprefix(PREFIX)), 1, p) for p in checkpoint_dirs(run_dir)
    ]
    remote = None
    if remote_url:
        remote = s3_checkpoints.RemoteRun(remote_url)
        candidates += [(r.step, 0, r) for r in remote.complete()]
    stamp = run_dir / "fingerprint.txt"
    fingerprint = stamp.read_text().strip() if stamp.is_file() else None
    for step, is_local, cand in sorted(candidates, key=lambda c: c[:2], reverse=True):
        local = cand if is_local else None
        try:
            if not is_local:
                if fingerprint and cand.manifest.get("fingerprint") != fingerprint:
                    raise CheckpointError(f"{cand.url}: from a run with other inputs (fingerprint differs)")
                local = remote.download(cand, run_dir)
                log.info("resuming from %s (step %d, newer than any local checkpoint)", cand.url, step)
            state = load_state(local, 0, world)
        except Exception as err:  # noqa: BLE001 - any failure to read means "not a good checkpoint"
            where = cand if is_local else cand.url
            why = _failure(local, 0, err) if local is not None else load_failure(err)
            log.warning("checkpoint %s is unreadable (%s); falling back to the previous one", where, why)
            rejected.append(where.name if is_local else cand.url)
            continue
        yield local, state
