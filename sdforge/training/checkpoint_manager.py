"""Saving a job's stateful components as one checkpoint (format: :mod:`sdforge.training.checkpoints`; the restore half:
:mod:`sdforge.training.checkpoint_restore`).

The components are registered by name (:data:`COMPONENTS`); each has ``state_dict()`` / ``load_state_dict()``,
and their entries share ``state.pt`` (disjoint keys, checked). The trained model writes its live weights as
files (:meth:`~sdforge.training.trained_model.FullUNet.write_live`); each rank's RNG goes to ``rng-rank<k>.pt``;
the sample ledger's segment is written before the checkpoint that lists it. A new piece of state is one
registration, not an edit of the save and the load code.

Each save gathers every rank's RNG state and ledger records to rank 0, which writes the ledger segment, then
the checkpoint (with the mean loss since the previous one, over all ranks, for ``keep_best``), prunes by
``train.keep_*``, and — with ``train.checkpoint_s3`` — queues their upload to the run's remote folder
``<checkpoint_s3>/<phase>/<input fingerprint>/`` (a run from other inputs never shares, and so never prunes,
another's copies). Every save is timed: :meth:`CheckpointManager.write_estimate` is what the preemption grace
is judged by.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from pathlib import Path

import torch

from sdforge.io import OutputError
from sdforge.training.async_checkpoint import (
    BackgroundWriter,
    CheckpointWriteError,
    HostBuffers,
    choose_async,
    fill,
    state_bytes,
)
from sdforge.training.checkpoint_restore import COMPONENTS, CheckpointRestore
from sdforge.training.checkpoints import (
    POSTHOC_DIR,
    PREFIX,
    Retention,
    capture_rng,
)
from sdforge.training.checkpoints import save_checkpoint as write_checkpoint
from sdforge.training.distributed import broadcast_object
from sdforge.training.ledger import LEDGER_DIR, write_segment
from sdforge.training.s3_checkpoints import BackgroundUploader, RemoteRun, run_url
from sdforge.training.sharded_save import ShardedSave

log = logging.getLogger(__name__)

AVERAGED = ("recent_losses",)
"""State entries that differ per rank (each rank's loss is over its own slice) and are saved as their mean."""
FIRST_WRITE_BYTES_PER_S = 100e6
"""Before a run has written a checkpoint, a write is estimated at this rate over its state's bytes (a slow
disk with the sha256 manifest: bench/README.md, checkpoint_write); afterwards from the measured writes."""


class CheckpointManager(CheckpointRestore, ShardedSave):
    """The checkpoints of one job's run dir: save (every rank takes part), restore the newest good one, upload."""

    def __init__(self, job, run_dir: Path, fingerprint: str):
        self.job, self.run_dir = job, run_dir
        cfg = job.cfg
        self.retention = Retention(cfg.keep_last, cfg.keep_every, cfg.keep_best)
        self.remote = run_url(cfg.checkpoint_s3, job.phase_name, fingerprint) if cfg.checkpoint_s3 else None
        self.uploader = None
        self.last_save_s: float | None = None
        """The longest a save held the step (the whole write when it blocks; the snapshot when it does not)."""
        self.mark = 0  # losses before this index were in the previous checkpoint's mean
        self.writer = BackgroundWriter()
        self.asynchronous: bool | None = None  # decided at the first save (train.async_checkpoint)
        self.buffers: HostBuffers | None = None
        self.defer_copy = True
        """On a CPU, whether the writer thread makes the snapshot's copy behind the next step (else the training
        thread makes it inside ``save``): ``bench.checkpoint_write`` measures both."""

    # -- save ------------------------------------------------------------------------------
    def write_estimate(self) -> float:
        """Seconds a checkpoint write is expected to take: the slowest measured one (+25 %; twice that while a
        background write is still in flight), else by size."""
        measured = self.last_save_s if self.writer.write_s is None else self.writer.write_s + (self.last_save_s or 0)
        if measured is None:
            weights = sum(p.numel() * p.element_size() for p in self.job.model.trainable)
            return 4 * weights / FIRST_WRITE_BYTES_PER_S  # live + EMA + AdamW's two moments
        return 1.25 * measured * (2 if self.writer.in_flight else 1)

    def save(self, wait: bool = False) -> Path | None:
        """Write a checkpoint at the current step (every rank takes part); its path on rank 0 once written —
        None while it is written in the background (``train.async_checkpoint``), unless ``wait``."""
        t0 = time.perf_counter()
        with self.job.busy("checkpoint"):
            path = self._save(wait)
        self.last_save_s = max(time.perf_counter() - t0, self.last_save_s or 0.0)  # the step's stall
        return path

    def state_dict(self) -> dict:
        """Every component's entries of ``state.pt`` (disjoint keys) and the run's global batch."""
        merged: dict = {"global_batch": self.job.plan.global_batch}
        for name in COMPONENTS:
            part = getattr(self.job, name).state_dict()
            clash = set(merged) & set(part)
            if clash:
                raise ValueError(f"checkpoint components share state keys {sorted(clash)}")
            merged.update(part)
        return merged

    def _gathered(self, state: dict) -> tuple:
        """The mean loss since the last checkpoint, every rank's RNG and ledger records (on the main rank)."""
        job, dist = self.job, self.job.dist
        losses = job.state.losses
        recent, self.mark = losses[self.mark :], len(losses)
        loss = sum(recent) / len(recent) if recent else None
        rng, records = [capture_rng(job.state.generator, dist.device)], [job.state.ledger.take()]
        if dist.world > 1:
            loss, rng, records = _gather_to_main(dist, recent, state, rng[0], records[0])
        return loss, rng, records

    def _save(self, wait: bool) -> Path | None:
        job, dist = self.job, self.job.dist
        state = self.state_dict()
        if job.model.sharded:
            return self._save_sharded(state, wait)
        asynchronous = self._asynchronous(state)
        loss, rng, records = self._gathered(state)
        path = None
        if dist.is_main:
            self.writer.wait()  # one write in flight: its buffers are about to be reused
            self._write_ledger(records)
            snapshot = (copy.copy(job.state.progress), list(job.state.ledger_segments), rng, loss)
            if asynchronous:
                path = self._submit(snapshot, state, wait)
            else:
                path = self._write(*snapshot, job.model.live_tensors(), state)
        if dist.world > 1 and (wait or not asynchronous):
            torch.distributed.barrier()
        return path

    def _submit(self, snapshot: tuple, state: dict, wait: bool) -> Path | None:
        """The background write of ``state`` and the live weights: copied into the host buffers now on CUDA (queued
        on the stream), or by the writer thread on a CPU while the next step runs up to its optimizer update
        (``Optimization.settle`` waits for the copy there)."""
        cuda = self.job.dist.device.type == "cuda"
        deferred = [] if self.defer_copy and not cuda else None
        live = self.buffers.copy(self.job.model.live_tensors(), "live", contiguous=True, deferred=deferred)
        state = self.buffers.copy(state, "state", deferred=deferred)
        ready = torch.cuda.Event() if cuda else None
        if ready is not None:
            ready.record()
        copy = None if deferred is None else (lambda: fill(deferred))
        self.writer.submit(lambda: self._write(*snapshot, live, state), ready, copy)
        if copy is not None:
            self.job.optim.snapshot_read = self.writer.wait_copied
        return self.writer.wait() if wait else None

    def _asynchronous(self, state: dict) -> bool:
        """Whether this run writes in the background: rank 0 decides at the first checkpoint (logged), every rank
        follows (their barriers must match)."""
        if self.asynchronous is None:
            dist, why = self.job.dist, ""
            if dist.is_main:
                size = state_bytes(state) + state_bytes(self.job.model.live_tensors())
                self.asynchronous, why = choose_async(self.job.cfg.async_checkpoint, dist.device, size)
                log.info("checkpoints %s (%s)", "in the background" if self.asynchronous else "block the step", why)
            self.asynchronous = bool(broadcast_object(self.asynchronous, dist.world))
            self.buffers = HostBuffers(pinned=True)
        return self.asynchronous

    def _write(self, progress, ledger: list[dict], rng: list, loss, live: dict, state: dict) -> Path:
        """The checkpoint's files, manifest and rename (then pruning and the upload): in the background or not."""
        def write_weights(folder: Path) -> None:
            self.job.model.write_live(folder, live)
            _slow_write_point()

        path = write_checkpoint(
            self.run_dir, progress, write_weights, state, self.retention,
            rng=rng, loss=loss, config=self.job.params.model_dump(mode="json"), ledger=ledger,
        )  # fmt: skip
        self._upload(path, ledger)
        return path

    def _write_ledger(self, records: list[dict]) -> None:
        """Rank 0: the records since the previous checkpoint as a segment, appended to the run's list."""
        state = self.job.state
        first = state.ledger_segments[-1]["name"] if state.ledger_segments else None
        start = int(first.split("-")[1].split(".")[0]) + 1 if first else 1
        if start > state.progress.step:  # nothing trained since (e.g. an epoch end right after a save)
            return
        entry = write_segment(self.run_dir, records, self.job.data, start, state.progress.step)
        state.ledger_segments = [*state.ledger_segments, entry]

    def _upload(self, path: Path, ledger: list[dict]) -> None:
        if self.remote is None:
            return
        if self.uploader is None:
            self.uploader = BackgroundUploader(RemoteRun(self.remote), self.run_dir, self.retention)
        step = int(path.name.removeprefix(PREFIX))  # the post-hoc snapshots up to it were written before it
        snapshots = [p for p in sorted((self.run_dir / POSTHOC_DIR).glob("step-*.safetensors"))
                     if int(p.name[5:13]) <= step]  # fmt: skip
        self.uploader.submit(path, [self.run_dir / LEDGER_DIR / e["name"] for e in ledger], snapshots)

    def finish_writes(self) -> Path | None:
        """Wait for the background write in flight (every rank: the others wait for rank 0's); its checkpoint."""
        path = self.writer.wait()
        if self.job.dist.world > 1 and self.asynchronous:
            torch.distributed.barrier()
        return path

    def close(self) -> None:
        """Wait for the write in flight and the pending uploads (a failed background write is logged)."""
        try:
            self.writer.wait()
        except (CheckpointWriteError, OutputError) as err:
            log.error("%s; the previous checkpoint is the newest complete one", err)
        if self.uploader:
            self.uploader.close()
            self.uploader = None


def _slow_write_point() -> None:
    """Fault injection for the kill tests: ``SDFORGE_SLOW_CHECKPOINT_S=N`` holds every checkpoint write N seconds
    after its weights, before its manifest and rename — a kill then lands inside a (background) write."""
    delay = float(os.environ.get("SDFORGE_SLOW_CHECKPOINT_S", "0"))
    if delay:
        time.sleep(delay)


def _gather_to_main(dist, recent: list[float], state: dict, rng: dict, records: dict):
    """Over every rank: the mean of the losses since the last checkpoint, the :data:`AVERAGED` state entries
    (averaged in place in ``state``), and (rank 0) every rank's RNG state and ledger records."""
    total = torch.tensor([sum(recent), len(recent)], dtype=torch.float64, device=dist.device)
    torch.distributed.all_reduce(total)
    loss = float(total[0] / total[1]) if total[1] else None
    for key in AVERAGED:
        values = torch.tensor(state[key], dtype=torch.float64, device=dist.device)  # same length on every rank
        torch.distributed.all_reduce(values)
        state[key] = (values / dist.world).tolist()
    gathered = [None] * dist.world if dist.is_main else None
    torch.distributed.gather_object((rng, records), gathered, dst=0)
    if not dist.is_main:
        return loss, [rng], [records]
    return loss, [g[0] for g in gathered], [g[1] for g in gathered]
