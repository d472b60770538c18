"""Run one DVC stage as ``dvc repro --single-item`` in its own process group.

DVC decides whether the stage is stale. The subprocess gets its own session so that a
timeout, a cancel or a crash of the caller kills the stage command together with ``dvc``
(killing ``dvc`` alone would orphan the stage, and the next run would start a second copy).
"""

from __future__ import annotations

import collections
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Lines DVC logs for a stage (dvc/stage/__init__.py, dvc/stage/run.py, dvc/stage/cache.py).
_RAN = "Running stage '{}'"
_RESTORED = "Stage '{}' is cached - skipping run"
_SKIPPED = "Stage '{}' didn't change, skipping"

KILL_GRACE_S = 10.0
TAIL_LINES = 40


class StageFailed(RuntimeError):
    """``dvc repro`` of one stage exited non-zero (or timed out); the message ends with its output tail."""


@dataclass(frozen=True)
class StageOutcome:
    stage: str
    status: str
    """``ran`` (the command ran), ``restored`` (outputs from DVC's run cache) or ``skipped``."""
    seconds: float


def stage_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for ``dvc``: this interpreter's bin dir first on PATH (stage commands
    say ``python -m stages...`` and must get this venv), analytics off, unbuffered output."""
    env = dict(os.environ if base is None else base)
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "")])
    env.setdefault("DVC_NO_ANALYTICS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def kill_group(proc: subprocess.Popen, grace_s: float = KILL_GRACE_S) -> None:
    """SIGTERM the process group of ``proc``, SIGKILL it after ``grace_s``, and reap ``proc``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
            # the leader is gone; make sure nothing else is left in its group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


def run_dvc_stage(
    root: str | Path,
    stage: str,
    *,
    log_line: Callable[[str], None] = print,
    timeout_s: float | None = None,
) -> StageOutcome:
    """``dvc repro --single-item <stage>`` in ``root``; stream each output line to ``log_line``.

    Raises :class:`StageFailed` with the last lines of output on a non-zero exit or a timeout.
    """
    cmd = [sys.executable, "-m", "dvc", "repro", "--single-item", stage]
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    lines: queue.Queue[str | None] = queue.Queue()
    status = "skipped"

    proc = subprocess.Popen(
        cmd,
        cwd=str(root),
        env=stage_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    reader = threading.Thread(target=pump, name=f"dvc-{stage}", daemon=True)
    reader.start()
    try:
        while True:
            if deadline is not None and time.monotonic() > deadline:
                kill_group(proc)
                raise StageFailed(
                    f"stage {stage} timed out after {timeout_s:g} s; last output:\n" + "\n".join(tail)
                )
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            tail.append(line)
            log_line(line)
            if _RAN.format(stage) in line:
                status = "ran"
            elif _RESTORED.format(stage) in line:
                status = "restored"
        rc = proc.wait()
    except BaseException:
        # cancel, TerminationSignal, KeyboardInterrupt, timeout: take the whole group down
        if proc.poll() is None:
            kill_group(proc)
        raise
    if rc != 0:
        raise StageFailed(f"dvc repro --single-item {stage} exited {rc}; last output:\n" + "\n".join(tail))
    return StageOutcome(stage=stage, status=status, seconds=round(time.monotonic() - start, 2))
