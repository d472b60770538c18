"""The save half of a sharded run's checkpoint (``train.parallel: fsdp``), a mixin of
:class:`~sdforge.training.checkpoint_manager.CheckpointManager` (format: :mod:`sdforge.training.sharded_state`;
docs/PARALLEL.md).

Every rank writes its shards of the weights, optimizer and EMA with DCP into a staging folder
``checkpoint-<step>.shards``; the main rank then makes the checkpoint of it (``sharded/``, ``state.pt`` without the
shards, RNG, the manifest over every file) and renames it into place. With ``train.async_checkpoint`` on (``auto``
decides as for a replicated run) the write runs in the background: ``dcp.async_save`` copies this rank's shards to
host memory before the step goes on and writes them on a thread, its collectives on a gloo group of their own (the
training's run on the default group meanwhile); the main rank's writer thread waits for DCP — every rank's shards and
DCP's metadata on disk — and then finishes the checkpoint. One write is in flight at a time: the next save, and the
run's end, wait for it. A kill before the rename leaves the staging folder, never a checkpoint.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import signal

import torch
import torch.distributed.checkpoint as dcp

from sdforge.training.checkpoints import checkpoint_name
from sdforge.training.sharded_state import live_keys, save_shards, split_shards

log = logging.getLogger(__name__)


class ShardedSave:
    """Writes a sharded checkpoint; needs the manager's ``job``, ``run_dir``, ``writer``, ``buffers``,
    ``_asynchronous``, ``_gathered``, ``_write_ledger`` and ``_write``."""

    shard_group = None
    """The gloo process group of the background DCP writes (made at the first one, every rank together)."""

    def _save_sharded(self, state: dict, wait: bool):
        """Every rank's shards into the staging folder, then the checkpoint (main rank); its path on the main rank
        once written — None while it is written in the background, unless ``wait``."""
        job, dist = self.job, self.job.dist
        background = self._asynchronous(state)
        loss, rng, records = self._gathered(state)
        state, flat = split_shards(state)
        flat = {**flat, **live_keys(job.model.live_tensors())}
        step = job.state.progress.step
        staging = self.run_dir / f"{checkpoint_name(step)}.shards"
        self.writer.wait()  # the write in flight first: its staging folder is not stale
        if dist.is_main:
            for stale in self.run_dir.glob("*.shards"):  # a kill during an earlier write: never a checkpoint
                shutil.rmtree(stale, ignore_errors=True)
        if dist.world > 1:
            torch.distributed.barrier()
        snapshot = None
        if dist.is_main:
            self._write_ledger(records)
            snapshot = (copy.copy(job.state.progress), list(job.state.ledger_segments), rng, loss)
        if background:
            return self._submit_shards(flat, staging, snapshot, state, wait)
        save_shards(flat, staging)
        _kill_in_shards_point(step)
        path = self._write(*snapshot, staging, state) if dist.is_main else None
        if dist.world > 1:
            torch.distributed.barrier()
        return path

    def _submit_shards(self, flat: dict, staging, snapshot, state: dict, wait: bool):
        """``dcp.async_save`` (this rank's shards copied to host memory now), then on the writer thread: wait for
        it, and on the main rank finish the checkpoint from a host copy of ``state``."""
        dist, step = self.job.dist, self.job.state.progress.step
        if self.shard_group is None:
            self.shard_group = torch.distributed.new_group(backend="gloo")
        written = dcp.async_save(flat, checkpoint_id=str(staging), process_group=self.shard_group)
        state = self.buffers.copy(state, "state") if dist.is_main else None

        def finish():
            written.result()  # on the main rank: every rank's shards and DCP's metadata are on disk
            _kill_in_shards_point(step)
            return self._write(*snapshot, staging, state) if dist.is_main else None

        self.writer.submit(finish)
        if not wait:
            return None
        path = self.writer.wait()
        if dist.world > 1:
            torch.distributed.barrier()
        return path


def _kill_in_shards_point(step: int) -> None:
    """Fault injection for the sharded kill test: ``SDFORGE_KILL_IN_SHARDS_AT_STEP=N`` SIGKILLs every rank once its
    shards of checkpoint N are staged, before the checkpoint exists (its manifest and rename)."""
    if os.environ.get("SDFORGE_KILL_IN_SHARDS_AT_STEP") == str(step):
        log.warning("SDFORGE_KILL_IN_SHARDS_AT_STEP=%d: killing this process inside a sharded write", step)
        os.kill(os.getpid(), signal.SIGKILL)
