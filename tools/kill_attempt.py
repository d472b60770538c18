"""One ``dvc`` invocation of the kill harness, possibly SIGKILLed at a kill point.

:func:`run_killable` runs ``dvc <args>`` in its own session, follows ``Running stage`` lines and
kills the whole process group when the kill point (see :mod:`tools.kill_harness`) comes:
a random moment inside a stage of the target type, inside a checkpoint write, or during a push.
"""

from __future__ import annotations

import os
import queue
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from flows.dvc_ops.runner import start_in_own_session, stream_lines
from tools.kill_checks import stage_type

RUNNING = re.compile(r"Running stage '([^']+)'")
SKIPPED = re.compile(r"Stage '([^']+)' didn't change, skipping")
RESTORED = re.compile(r"Stage '([^']+)' is cached - skipping run")
SPECIAL_TARGETS = ("checkpoint", "push")


def dvc_env() -> dict[str, str]:
    """The environment every ``dvc`` run of the harness gets: offline, no analytics, 2 OpenMP threads."""
    env = dict(os.environ)
    env.update(
        NO_ALBUMENTATIONS_UPDATE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        WANDB_MODE="disabled",
        DVC_NO_ANALYTICS="1",
        SDFORGE_PROGRESS="0",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="2",
    )
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    for key in ("MLFLOW_TRACKING_URI", "PYTHONPATH"):
        env.pop(key, None)
    return env


# -- one `dvc` invocation, possibly killed -------------------------------------------------------
@dataclass
class Attempt:
    lines: list[str] = field(default_factory=list)
    ran: list[str] = field(default_factory=list)
    """Stages in the order DVC logged ``Running stage``."""
    skipped: list[str] = field(default_factory=list)
    rc: int | None = None
    killed_in: str | None = None
    """Where the kill landed: the running stage (``+ckpt`` inside a checkpoint write), or ``push``."""
    killed_at_s: float | None = None
    leftover_pids: list[int] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def completed(self) -> list[str]:
        """Stages DVC finished (it moved on to the next one, or exited 0 after it) plus skipped ones."""
        done = list(self.skipped)
        done += self.ran[:-1]
        if self.ran and self.rc == 0:
            done.append(self.ran[-1])
        return done


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state ppid pgrp ...
            members.append(int(entry.name))
    return members


def kill_group(proc: subprocess.Popen) -> list[int]:
    """SIGKILL the process group, reap the leader, return PIDs of the group still alive after 5 s."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + 5
    while (left := _group_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


class _KillTimer:
    """When to kill one attempt aimed at ``target`` (the kill points are in the module docstring)."""

    def __init__(self, target: str | None, rng: random.Random, durations: dict[str, float], runs_dir: Path):
        self.target, self.rng, self.durations, self.runs_dir = target, rng, durations, runs_dir
        self.stage_start = time.monotonic()
        self.kill_at: float | None = None
        if target == "push":
            self.kill_at = self.stage_start + rng.uniform(0.2, 0.9) * durations.get("push", 3.0)
        self.stale = {_identity(p) for p in _half_written_checkpoints(runs_dir)}  # left by an earlier kill

    @property
    def poll_s(self) -> float:
        """How long to wait for an output line: short while watching for a checkpoint write."""
        return 0.01 if self.target == "checkpoint" else 0.05

    def checkpoint_being_written(self) -> bool:
        """A checkpoint write started in this attempt and has not been renamed into place yet."""
        return _new_half_written(self.runs_dir, self.stale)

    def due(self, now: float, current: str | None) -> bool:
        """Kill now: the kill time has come, or (``checkpoint``) ``current``, a train stage, writes a checkpoint."""
        if self.target == "checkpoint" and current and stage_type(current) == "train" and self.runs_dir.is_dir():
            if self.checkpoint_being_written():
                self.kill_at = now
        return self.kill_at is not None and now >= self.kill_at

    def seconds_in_stage(self) -> float:
        return round(time.monotonic() - self.stage_start, 2)

    def stage_started(self, stage: str) -> None:
        """Restart the stage clock; if ``stage`` is of the target type (or is the target, ``type@item``), pick a
        kill time inside it."""
        self.stage_start = time.monotonic()
        self.kill_at = None
        if self.target not in SPECIAL_TARGETS and self.target in (stage, stage_type(stage)):
            self.kill_at = self.stage_start + self.rng.uniform(0.05, 0.9) * self.durations.get(stage, 2.0)


def _record_line(att: Attempt, timer: _KillTimer, line: str) -> None:
    """Note a stage that DVC starts (closing the previous stage's clock) or skips."""
    if m := RUNNING.search(line):
        if att.ran:
            att.stage_seconds[att.ran[-1]] = timer.seconds_in_stage()
        att.ran.append(m[1])
        timer.stage_started(m[1])
    elif m := SKIPPED.search(line) or RESTORED.search(line):
        att.skipped.append(m[1])


def _kill_attempt(att: Attempt, proc: subprocess.Popen, lines: queue.Queue, timer: _KillTimer, now: float) -> None:
    """SIGKILL the attempt's group; note where the kill landed and read what was left in the pipe."""
    target = timer.target
    current = att.ran[-1] if att.ran else None
    att.killed_in = "push" if target == "push" else f"{current}{'+ckpt' if target == 'checkpoint' else ''}"
    att.killed_at_s = round(now - timer.stage_start, 2)
    att.leftover_pids = kill_group(proc)
    att.rc = proc.returncode
    if target == "checkpoint" and not timer.checkpoint_being_written():
        att.killed_in += "(done)"  # the write had finished (renamed into place) before the kill
    while (line := _drain(lines)) is not None:
        att.lines.append(line)
        if (m := RUNNING.search(line)) and target != "push":  # DVC had moved on before the kill
            att.ran.append(m[1])
            att.killed_in = m[1]


def run_killable(
    root: Path, args: list[str], target: str | None, rng: random.Random, durations: dict[str, float], log
) -> Attempt:
    """Run ``dvc <args>`` in its own session; kill it at ``target`` (see the module docstring)."""
    att = Attempt()
    proc = start_in_own_session([sys.executable, "-m", "dvc", *args], root, dvc_env())
    lines = stream_lines(proc)
    timer = _KillTimer(target, rng, durations, root / "runs")
    while True:
        now = time.monotonic()
        if timer.due(now, att.ran[-1] if att.ran else None):
            _kill_attempt(att, proc, lines, timer, now)
            return att
        try:
            line = lines.get(timeout=timer.poll_s)
        except queue.Empty:
            continue
        if line is None:
            break
        att.lines.append(line)
        log(line)
        _record_line(att, timer, line)
    att.rc = proc.wait()
    if att.ran:
        att.stage_seconds[att.ran[-1]] = timer.seconds_in_stage()
    return att


def _half_written_checkpoints(runs_dir: Path) -> list[Path]:
    """``runs/<phase>/checkpoint-*.tmp``: a checkpoint being written (renamed into place when done)."""
    try:
        return [p for d in runs_dir.iterdir() if d.is_dir() for p in d.iterdir() if p.name.endswith(".tmp")]
    except FileNotFoundError:  # renamed or pruned while listing
        return []


def _identity(path: Path) -> tuple[Path, int, int]:
    st = path.stat()
    return path, st.st_ino, st.st_ctime_ns  # inodes are reused at once; ctime changes with every entry added


def _new_half_written(runs_dir: Path, stale: set[tuple[Path, int, int]]) -> bool:
    """A checkpoint write started in this attempt (``save_checkpoint`` recreates the ``.tmp`` dir)."""
    for p in _half_written_checkpoints(runs_dir):
        try:
            if _identity(p) not in stale:
                return True
        except FileNotFoundError:
            continue
    return False


def _drain(lines: queue.Queue) -> str | None:
    try:
        return lines.get(timeout=0.5)
    except queue.Empty:
        return None
