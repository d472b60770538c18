"""Hangs: a check before step 0 that every rank plans the same job, and a watchdog while it runs.

Multi-GPU jobs hang rather than crash (uneven per-rank batch counts, a dead rank, a stuck collective),
and a hung job burns GPU-hours silently.

* :func:`check_ranks_agree` — before step 0 every rank all-gathers its planned micro-batches per epoch
  and fingerprints of its data and config; any difference is an error naming the ranks and values.
* :class:`Watchdog` — a thread per rank. The training loop :meth:`~Watchdog.beat`\\ s after every step;
  each rank also publishes ``(step, tick)`` in the job's c10d store. If a rank's own step makes no progress
  for the timeout (``train.hang_timeout_s``; default 20 × the slowest step so far, ≥ 300 s; long operations
  — startup, checkpoints, validation — get 10 × it), the watchdog reads every rank's heartbeat, names the
  ranks behind (a lower step) or silent (no tick: the process is gone), dumps every thread's Python stack
  (:mod:`faulthandler`) to stderr — the stage log — and exits with :data:`sdforge.training.exits.HUNG`
  so the orchestrator retries from the last checkpoint. ``faulthandler.dump_traceback_later`` backs it up
  should the main thread hold the GIL forever.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import logging
import os
import sys
import threading
import time

import torch

from sdforge.io import InputError
from sdforge.training.exits import HUNG, write_marker
from sdforge.training.hooks import Hook

log = logging.getLogger(__name__)

AUTO_FLOOR_S = 300.0
AUTO_STEPS = 20.0
"""Auto timeout: ``AUTO_STEPS`` × the slowest step so far, at least ``AUTO_FLOOR_S``."""
LONG_OP_FACTOR = 10.0
"""Startup, checkpoint writes and validation may take this many timeouts."""
ON_FIRE_S = 15.0
"""How long a firing watchdog waits for its ``on_fire`` report (a tracking server may be down too)."""


class RankMismatch(InputError):
    """Ranks plan different jobs; training would hang or train on different data."""


def fingerprint(value) -> str:
    """A short hash of a JSON-able value (a rank's config or data facts)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_ranks_agree(dist, facts: dict) -> None:
    """All-gather ``facts`` (JSON-able; e.g. micro-batches per epoch, data and config fingerprints) from every
    rank; raise :class:`RankMismatch` on every rank naming the ranks and values that differ from rank 0's."""
    if dist.world == 1:
        return
    gathered: list = [None] * dist.world
    torch.distributed.all_gather_object(gathered, facts)
    problems = []
    for key in facts:
        values = [g.get(key) for g in gathered]
        odd = [r for r, v in enumerate(values) if v != values[0]]
        if odd:
            shown = "; ".join(f"rank {r}: {_short(values[r])}" for r in [0, *odd])
            problems.append(f"{key} differs on rank(s) {', '.join(map(str, odd))} ({shown})")
    if problems:
        raise RankMismatch(
            "ranks disagree before step 0, so DDP would hang or train on different data: " + "; ".join(problems)
            + ". Every rank must see the same params, phase index and latent store (check each node's files)."
        )


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 120 else text[:117] + "..."


class Watchdog:
    """See the module docstring. ``timeout_s`` None: automatic."""

    def __init__(
        self, dist, timeout_s: float | None, store=None, interval_s: float | None = None, run_dir=None, on_fire=None
    ):
        self.dist, self.fixed, self.run_dir = dist, timeout_s, run_dir
        self.on_fire = on_fire
        """Called with the diagnosis before the process exits (bounded: :data:`ON_FIRE_S`), e.g. to end the
        MLflow run as KILLED."""
        self.store = store if store is not None else _default_store(dist)
        self.slowest = 0.0
        self.step = -1
        self.last_beat = time.monotonic()
        self.last_step_time: float | None = None
        self.allowance = self.timeout() * LONG_OP_FACTOR  # startup: the first step may compile, load, ...
        self.interval = interval_s or min(5.0, max(0.2, self.timeout() / 10))
        self.tick = 0
        self.waiting = 0  # 1 from a step's first micro-batch to its end: its collectives wait for every rank
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="sdforge-watchdog", daemon=True)
        self.thread.start()
        self._arm_backstop()

    def timeout(self) -> float:
        return self.fixed if self.fixed else max(AUTO_FLOOR_S, AUTO_STEPS * self.slowest)

    def beat(self, step: int) -> None:
        """Step ``step`` is done: reset the clock; the next step gets the normal timeout."""
        now = time.monotonic()
        with self._lock:
            if self.last_step_time is not None and step > self.step:
                self.slowest = max(self.slowest, now - self.last_step_time)
            self.step, self.last_beat, self.last_step_time = step, now, now
            self.allowance = self.timeout()
        self.waiting = 0
        self._arm_backstop()

    def in_step(self, inside: bool) -> None:
        """Mark starting a step (its collectives wait for every rank): a hang then names who never started it."""
        self.waiting = int(inside)
        self._publish()

    def long_operation(self) -> None:
        """A checkpoint write or a validation pass starts now: it may take ``LONG_OP_FACTOR`` timeouts."""
        with self._lock:
            self.last_beat = time.monotonic()
            self.allowance = self.timeout() * LONG_OP_FACTOR
        self.in_step(True)  # a checkpoint's collectives wait for every rank too
        self._arm_backstop()

    def step_resumes(self) -> None:
        """The long operation is over: back to the step timeout from now (its time does not count as a step)."""
        with self._lock:
            self.last_beat = self.last_step_time = time.monotonic()
            self.allowance = self.timeout()
        self._arm_backstop()

    def close(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()
        self.thread.join(timeout=5)

    def _arm_backstop(self) -> None:
        """If even this thread cannot run (GIL held forever), faulthandler dumps the stacks and exits."""
        faulthandler.dump_traceback_later(self.allowance * 2 + 30, exit=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.tick += 1
            self._publish()
            with self._lock:
                stalled = time.monotonic() - self.last_beat
                allowance, step = self.allowance, self.step
            if stalled > allowance:
                self._fire(stalled, allowance, step)

    def _publish(self) -> None:
        if self.store is None:
            return
        try:
            self.store.set(f"sdforge/heartbeat/{self.dist.rank}", f"{self.step} {self.tick} {self.waiting}")
        except Exception:  # noqa: BLE001 - the store's host may be gone; _fire reports it
            pass

    def _heartbeats(self) -> dict[int, tuple[int, int, int] | None]:
        beats: dict[int, tuple[int, int, int] | None] = {}
        for rank in range(self.dist.world):
            try:
                step, tick, waiting = self.store.get(f"sdforge/heartbeat/{rank}").decode().split()
                beats[rank] = (int(step), int(tick), int(waiting))
            except Exception:  # noqa: BLE001 - missing key, store down
                beats[rank] = None
        return beats

    def diagnose(self) -> str:
        """Which ranks are behind (lower step) or silent (their heartbeat stopped), from the store."""
        if self.dist.world == 1 or self.store is None:
            return "one process: it is the one stuck"
        first = self._heartbeats()
        for _ in range(3):  # keep this rank's own heartbeat going while the others' are watched
            time.sleep(self.interval)
            self.tick += 1
            self._publish()
        second = self._heartbeats()
        silent = [
            r for r in first
            if r != self.dist.rank and (first[r] is None or second[r] is None or second[r][1] == first[r][1])
        ]
        steps = {r: b[0] for r, b in second.items() if b is not None}
        ahead = max(steps.values()) if steps else -1
        behind = [r for r, s in steps.items() if s < ahead]
        waiting = [r for r, b in second.items() if b is not None and b[2]]
        if waiting and not behind:  # some are inside the next step, waiting in its collectives for the others
            behind = [r for r in steps if r not in waiting and r not in silent]
        parts = [f"rank {r} after step {s}{' (waiting)' if r in waiting else ''}" for r, s in sorted(steps.items())]
        verdict = []
        if behind:
            verdict.append(
                f"lagging: rank(s) {', '.join(map(str, behind))} (rank(s) {', '.join(map(str, waiting)) or '-'} "
                f"wait for them after step {ahead})"
            )
        if silent:
            verdict.append(f"silent (process dead or frozen): rank(s) {', '.join(map(str, silent))}")
        if not verdict:
            verdict.append("every rank is at the same step: a collective or the data loader is stuck on all")
        return "; ".join(verdict) + f" [{', '.join(parts)}]"

    def _fire(self, stalled: float, allowance: float, step: int) -> None:
        rank = self.dist.rank
        try:
            why = self.diagnose()
        except Exception as err:  # noqa: BLE001 - the diagnosis must not stop the exit
            why = f"heartbeats unreadable ({err})"
        log.critical(
            "hang watchdog (rank %d): no progress for %.0f s after step %d (limit %.0f s, train.hang_timeout_s); "
            "%s. Every thread's stack follows; exiting with status %d so the orchestrator retries from the last "
            "checkpoint.", rank, stalled, step, allowance, why, HUNG,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stderr.write(f"--- rank {rank}: Python stacks of every thread ---\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        if self.run_dir is not None:
            write_marker(self.run_dir, HUNG, {"rank": rank, "step": step, "stalled_s": round(stalled, 1), "why": why})
        if self.on_fire is not None:
            reporter = threading.Thread(target=self.on_fire, args=(f"hung after step {step}: {why}",), daemon=True)
            reporter.start()
            reporter.join(ON_FIRE_S)
        os._exit(HUNG)


def _default_store(dist):
    """The job's c10d key-value store (torchrun's, or the process group's), None on one process."""
    if dist.world == 1 or not torch.distributed.is_initialized():
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store  # private: guarded, only with world > 1

        return _get_default_store()
    except Exception as err:  # noqa: BLE001 - private API: without it the watchdog still fires, unnamed
        log.warning("hang watchdog: no c10d store (%s); a hang will not name the lagging rank", err)
        return None


class WatchdogHook(Hook):
    """Runs a :class:`Watchdog` while the job trains: a step starts and ends it, a long operation of the job
    (:meth:`~sdforge.training.job.TrainJob.busy`) or of another rank after this step (``report.busy``:
    validation on the main rank) gets the long allowance. On firing it ends the job's reports
    (:meth:`~sdforge.training.job.TrainJob.abort`)."""

    def __init__(self, timeout_s: float | None, run_dir):
        self.timeout_s, self.run_dir = timeout_s, run_dir
        self.watchdog: Watchdog | None = None

    def start(self, job) -> None:
        self.watchdog = Watchdog(job.dist, self.timeout_s, run_dir=self.run_dir, on_fire=job.abort)
        job.busy_listeners.append(self._busy)

    def _busy(self, name: str, started: bool) -> None:
        if self.watchdog is None:  # after the last step (a hook's end: post-hoc EMA, validation loss)
            return
        if started:
            self.watchdog.long_operation()
        else:
            self.watchdog.step_resumes()

    def before_step(self, job) -> None:
        self.watchdog.in_step(True)  # its collectives (DDP's gradient all-reduce, agree) wait for every rank

    def after_step(self, job, report) -> None:
        self.watchdog.beat(report.step)
        if report.busy:  # until the next beat: this rank waits in the next step for the busy one
            self.watchdog.long_operation()

    def end(self, job) -> None:
        self.close(None)

    def close(self, error: BaseException | None) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
            self.watchdog = None
