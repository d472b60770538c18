"""Checkpoints written in the background: the state is copied off the training tensors at the step boundary, and
the files, their sha256 manifest and the upload happen on a writer thread while training goes on.

- :class:`HostBuffers` copies a nested state (dicts, lists, tuples of tensors and plain values) into host tensors
  it allocates once and reuses: pinned memory filled by non-blocking copies on CUDA (the copy is ordered on the
  stream before the next step's in-place updates; the writer waits on a CUDA event, the training thread never
  synchronises), plain memory on a CPU. Live weights get contiguous buffers (safetensors); optimizer and EMA
  state keep their layout (``torch.save`` keeps strides, so a resumed run's state is laid out as before).
- On a CPU the copy itself is a memory copy as long as the state (~2 s for 10 GiB on a 2-core VM), so it is
  *deferred*: the writer thread makes it first, while the next step's forward and backward run (they only read
  the weights), and the trainer waits for it (:meth:`BackgroundWriter.wait_copied`, through
  ``Optimization.settle``) only before something changes the weights, the optimizer or the EMA — the next
  optimizer update, or validation swapping the EMA weights in.
- :class:`BackgroundWriter` runs one write at a time: a new snapshot first waits for the write in flight (its
  buffers are about to be reused), so memory holds at most one extra copy of the state.

A kill during a background write leaves the temp folder (``checkpoint-N.tmp``) and the previous checkpoint as
the newest complete one: ``COMPLETE`` is written last and the folder renamed into place
(:mod:`sdforge.training.checkpoints`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from sdforge.io import OutputError

log = logging.getLogger(__name__)

MEMORY_MARGIN_BYTES = 2 * 2**30
"""On a CPU, ``async_checkpoint: auto`` needs this much free memory beyond a second copy of the state."""


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed; the previous checkpoint is still the newest complete one."""


class HostBuffers:
    """Host copies of a nested state, in buffers allocated on the first copy and reused after."""

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self.buffers: dict[str, torch.Tensor] = {}

    def copy(self, value, path: str = "", contiguous: bool = False, deferred: list | None = None):
        """``value`` with every tensor replaced by its host buffer, filled now (asynchronously on CUDA) — or, with
        ``deferred``, left to fill: its ``(buffer, tensor)`` pairs are appended there for :func:`fill`."""
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value.detach(), path, contiguous, deferred)
        if isinstance(value, dict):
            return {k: self.copy(v, f"{path}/{k}", contiguous, deferred) for k, v in value.items()}
        if isinstance(value, list | tuple):
            copied = [self.copy(v, f"{path}/{i}", contiguous, deferred) for i, v in enumerate(value)]
            return copied if isinstance(value, list) else tuple(copied)
        return value

    def _copy_tensor(self, tensor: torch.Tensor, path: str, contiguous: bool, deferred: list | None) -> torch.Tensor:
        buf = self.buffers.get(path)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            pin = self.pinned and tensor.device.type == "cuda"
            if contiguous:
                buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            else:
                buf = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, pin_memory=pin)
            self.buffers[path] = buf
        if deferred is None:
            buf.copy_(tensor, non_blocking=buf.is_pinned())
        else:
            deferred.append((buf, tensor))
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def fill(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``(buffer, tensor)`` pair of :meth:`HostBuffers.copy`'s ``deferred`` list."""
    for buf, tensor in pairs:
        buf.copy_(tensor)


def state_bytes(value) -> int:
    """Bytes of every tensor in a nested state (of a sharded one: this rank's shards)."""
    if isinstance(value, DTensor):  # this rank's shard
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(state_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(state_bytes(v) for v in value)
    return 0


def memory_available() -> int:
    """``MemAvailable`` of /proc/meminfo in bytes (0 where unknown: then async stays off on a CPU)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def choose_async(setting: str, device: torch.device, snapshot_bytes: int) -> tuple[bool, str]:
    """Whether checkpoints are written in the background (``train.async_checkpoint``), and why."""
    if setting != "auto":
        return setting == "on", f"train.async_checkpoint: {setting}"
    if device.type == "cuda":
        return True, "auto: CUDA (pinned host buffers)"
    free = memory_available()
    fits = snapshot_bytes + MEMORY_MARGIN_BYTES <= free
    why = f"a second copy of the state ({snapshot_bytes / 2**30:.2f} GiB) {'fits' if fits else 'does not fit'} in " \
          f"the {free / 2**30:.2f} GiB free"  # fmt: skip
    return fits, f"auto on a CPU: {why}"


class BackgroundWriter:
    """One checkpoint write at a time on a thread; :meth:`wait` returns its checkpoint or raises its failure."""

    def __init__(self):
        self.thread: threading.Thread | None = None
        self.copied = threading.Event()
        """Set once the write in flight no longer reads the training state (at once unless a copy was deferred)."""
        self.copied.set()
        self.result: Path | None = None
        self.error: BaseException | None = None
        self.write_s: float | None = None
        """The slowest background write so far, in seconds (snapshot excluded)."""

    @property
    def in_flight(self) -> bool:
        """Whether a write was submitted and not yet waited for."""
        return self.thread is not None

    @property
    def busy(self) -> bool:
        """Whether the write in flight is still running."""
        return self.thread is not None and self.thread.is_alive()

    def submit(self, write: Callable[[], Path], ready: torch.cuda.Event | None = None, copy: Callable | None = None):
        """Start ``write()`` on the writer thread: after ``ready`` (the snapshot's CUDA copies) completes, or after
        ``copy()`` (a deferred CPU copy: :meth:`wait_copied` waits for it)."""
        self.wait()
        self.result = self.error = None
        if copy is not None:
            self.copied.clear()
        args = (write, ready, copy)
        self.thread = threading.Thread(target=self._run, args=args, name="sdforge-checkpoint", daemon=True)
        self.thread.start()

    def _run(self, write: Callable[[], Path], ready, copy) -> None:
        t0 = time.perf_counter()
        try:
            if ready is not None:
                ready.synchronize()
            if copy is not None:
                try:
                    copy()
                finally:
                    self.copied.set()
            self.result = write()
        except BaseException as err:  # noqa: BLE001 - handed to the training thread by wait()
            self.error = err
        finally:
            self.write_s = max(time.perf_counter() - t0, self.write_s or 0.0)

    def wait_copied(self) -> None:
        """Wait until the write in flight has copied the training state (it may go on writing)."""
        self.copied.wait()

    def wait(self) -> Path | None:
        """Wait for the write in flight (if any); its checkpoint, or a CheckpointWriteError with its cause — a write
        fault (full disk, file-size limit, …) is re-raised on the caller's thread as the writer's
        :class:`~sdforge.io.OutputError` (one line, status 2 from the stage CLI)."""
        if self.thread is None:
            return None
        self.thread.join()
        self.thread = None
        if self.error is not None:
            error, self.error = self.error, None
            if isinstance(error, OutputError):  # a write fault: its one line (path, cause, what to do) as it is
                raise error
            raise CheckpointWriteError(f"background checkpoint write failed: {error}") from error
        return self.result
