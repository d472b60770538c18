"""A phase's run directory and exported weights: the input fingerprint that decides whether a run dir
may be resumed, and the ``unet/``, ``unet_ema/``, ``state.json`` output of ``train@<phase>``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import shutil
from pathlib import Path

import torch

from sdforge.io import write_json
from sdforge.training.adapter_files import write_lora_folder, write_plain_unet
from sdforge.training.distributed import broadcast_object
from sdforge.training.exits import clear_markers
from sdforge.training.trainer import LOSS_TAIL, Trainer

log = logging.getLogger(__name__)

NOT_TRAINING = {
    "validation_every", "validation_prompts", "log_every", "progress_bar", "preempt_grace_s", "hang_timeout_s",
    "nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint",
}
"""``train`` settings that leave a run resumable when changed: reporting, failure handling, and the job's shape
(a run resumes on another world size with its global batch kept: docs/RESILIENCE.md)."""



def fingerprint(*files_or_dirs: Path, extra: dict) -> str:
    """Hash of the phase's inputs: a run dir from other inputs is stale and must not be resumed."""
    h = hashlib.sha256(json.dumps(extra, sort_keys=True, default=str).encode())
    for root in files_or_dirs:
        for f in sorted([root] if root.is_file() else root.rglob("*")):
            if f.is_file():
                h.update(f.relative_to(root.parent).as_posix().encode())
                _hash_file(h, f)
    return h.hexdigest()[:16]


def _hash_file(h, path: Path, chunk: int = 16 << 20) -> None:
    """Feed ``path``'s bytes to ``h`` in chunks (a 3.4 GB checkpoint is never held in memory whole)."""
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)


def prepare_run_dir(run_dir: Path, fp: str, is_main: bool) -> None:
    """Start ``run_dir`` afresh (main rank) unless its stamp says it holds a run from the same inputs."""
    stamp = run_dir / "fingerprint.txt"
    if is_main:
        if run_dir.exists() and (not stamp.is_file() or stamp.read_text().strip() != fp):
            log.warning("%s holds a run from other inputs; starting this phase afresh", run_dir)
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        stamp.write_text(fp + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def open_run_dir(params, tr: Trainer) -> tuple[Path, str]:
    """The phase's run dir, kept when its fingerprint (phase, training settings but :data:`NOT_TRAINING`, index,
    init weights) matches, else started afresh; stale exit markers cleared. Returns it and the fingerprint."""
    paths, phase_name = params.paths, tr.phase_name
    run_dir = Path(paths.runs) / phase_name
    fp = fingerprint(
        Path(paths.mixes) / f"{phase_name}.parquet",
        Path(paths.checkpoints) / tr.phase.init_from,
        extra={"phase": tr.phase.model_dump(), "train": params.train.model_dump(exclude=NOT_TRAINING)},
    )
    prepare_run_dir(run_dir, fp, tr.dist.is_main)
    if tr.dist.is_main:
        clear_markers(run_dir)
    return run_dir, fp


def leave_process_group(tr: Trainer) -> None:
    """Tear DDP down in an order that cannot deadlock (nothing to do on one process).

    gloo's worker threads release a finished collective's tensors, which needs the GIL; the process group's
    destructor joins those threads while holding it. Freed at ``run``'s return (the DDP reducer holds the
    group), a rank hung about one run in four. A barrier lets the workers finish (waiting releases the GIL),
    and the reducer is freed while the default group still holds the process group alive.
    """
    if tr.dist.world == 1:
        return
    torch.distributed.barrier()
    tr.model = None
    gc.collect()
    torch.distributed.destroy_process_group()


RUN_GLOBAL_BATCH = "global_batch.json"
"""In the run dir: the global batch the run started with. A run resumed with no checkpoint yet (killed before
its first) on another world size keeps it, as one resumed from a checkpoint does."""


def keep_global_batch(tr: Trainer, run_dir: Path, restored: bool) -> None:
    """Fix the run's global batch at its first start: without a checkpoint, take the one recorded in the run dir
    (rank 0's, broadcast); record it (main rank); then refuse a plan without steps (:meth:`Trainer.check_plan`)."""
    path = run_dir / RUN_GLOBAL_BATCH
    saved = None
    if tr.dist.is_main and not restored and path.is_file():
        saved = json.loads(path.read_text()).get("global_batch")
    saved = broadcast_object(saved, tr.dist.world)
    if isinstance(saved, int) and saved != tr.split.global_batch:
        log.info("run %s started with global batch %d: keeping it on %d rank(s)", run_dir, saved, tr.dist.world)
        tr.set_global_batch(saved)
    if tr.dist.is_main:
        write_json(path, {"global_batch": tr.split.global_batch})
    tr.check_plan()


def export_phase(tr: Trainer, out_dir: Path, final_loss: float | None) -> None:
    """Write ``unet/`` (live), ``unet_ema/`` and ``state.json`` — the phase's DVC output; an adapter phase also
    writes ``adapter/`` (live) and ``adapter_ema/`` (diffusers LoRA files, :mod:`sdforge.training.adapter_files`).

    Called once training is over (the last resumable checkpoint is on disk): the optimizer state is
    released first and the EMA weights are copied into ``tr.unet`` itself rather than swapped through a
    stored copy, so the export needs no memory beyond training's (at full size on a 24 GiB CPU machine the
    stored copy alone was 3.4 GB). Afterwards ``tr.unet`` holds the EMA weights.
    """
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    tr.optimizer.state.clear()
    gc.collect()
    _write_weights(tr, out_dir, "unet", "adapter")
    tr.ema.copy_to(tr.trainable)
    _write_weights(tr, out_dir, "unet_ema", "adapter_ema")
    state = {
        "phase": tr.phase_name,
        "step": tr.progress.step,
        "epochs": tr.progress.epoch,
        "final_loss": final_loss,
        "objective": tr.objective,
        "flow_shift": tr.phase.flow_shift,
    }
    if tr.is_adapter:
        state["adapter"] = tr.phase.adapter.model_dump()
    write_json(out_dir / "state.json", state)


def _write_weights(tr: Trainer, out_dir: Path, unet_dir: str, adapter_dir: str) -> None:
    """The UNet's current weights as ``out_dir/unet_dir`` (+ ``out_dir/adapter_dir`` for an adapter phase)."""
    if not tr.is_adapter:
        tr.unet.save_pretrained(out_dir / unet_dir, safe_serialization=True)
        return
    write_lora_folder(tr.unet, out_dir / adapter_dir)
    write_plain_unet(tr.unet, out_dir / unet_dir, merge=tr.phase.adapter.merge)


def tail_mean(values: list[float], n: int = LOSS_TAIL) -> float | None:
    """The mean of the last ``n`` values (rounded), None when there are none."""
    tail = values[-n:]
    return round(sum(tail) / len(tail), 6) if tail else None
