"""Run one DVC stage as ``dvc repro --single-item`` in its own process group.

DVC decides whether the stage is stale. The subprocess gets its own session so that a
timeout, a cancel or a crash of the caller kills the stage command together with ``dvc``
(killing ``dvc`` alone would orphan the stage, and the next run would start a second copy).

Before each run, :func:`clear_stale_locks` drops what a killed ``dvc`` left in ``.dvc/tmp``: DVC
itself forgets ``rwlock`` entries whose PID no longer exists, but refuses to run ("... is busy, it
is being blocked by: (PID N)") while that PID is an unreaped zombie or has been reused by another
program. Entries held by a live ``dvc`` process are kept.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import json
import logging
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

import psutil

# Lines DVC logs for a stage (dvc/stage/__init__.py, dvc/stage/run.py, dvc/stage/cache.py).
_RAN = "Running stage '{}'"
_RESTORED = "Stage '{}' is cached - skipping run"
_SKIPPED = "Stage '{}' didn't change, skipping"

log = logging.getLogger(__name__)

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


def lock_holder_state(pid: int) -> str:
    """What holds a DVC lock entry: ``dead``, ``zombie``, ``other`` (a live process that is not
    ``dvc``, i.e. a reused PID) or ``dvc`` (a live ``dvc`` process, or an in-process DVC ``Repo``)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return "zombie"
        argv = proc.cmdline()
    except psutil.NoSuchProcess:
        return "dead"
    except psutil.AccessDenied:
        return "dvc"  # cannot tell: keep it
    if pid == os.getpid() or _is_dvc_command(argv):
        return "dvc"
    return "other"


def _is_dvc_command(argv: list[str]) -> bool:
    """``dvc ...``, ``python -m dvc ...``, or a Python program using DVC's API whose argv mentions dvc."""
    for i, arg in enumerate(argv[:3]):
        if Path(arg).name == "dvc" or (arg == "-m" and i + 1 < len(argv) and argv[i + 1] == "dvc"):
            return True
    return False


@contextlib.contextmanager
def _flock(path: Path):
    """Hold DVC's guard of ``rwlock`` (``rwlock.lock``, a zc.lockfile ``flock``) while editing it."""
    with open(path, "a+") as f:
        deadline = time.monotonic() + 10
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as err:
                if err.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def clear_stale_locks(root: str | Path) -> list[str]:
    """Remove the ``.dvc/tmp/rwlock`` entries and the ``.dvc/tmp/lock`` file that no live ``dvc`` holds.

    ``rwlock`` (``{"write": {path: {"pid", "cmd"}}, "read": {path: [{"pid", "cmd"}, ...]}}``, see
    ``dvc/rwlock.py``) is edited under its guard file ``rwlock.lock``, as DVC does. ``lock`` is a
    ``zc.lockfile`` (an ``flock`` plus the holder's PID as text): it is removed when nobody holds the
    ``flock`` (a held one belongs to a live process and is kept). With ``core.hardlink_lock`` the lock
    file names no PID, and it is left alone. Returns a line per removal; rwlock ones are logged as
    warnings.
    """
    tmp = Path(root) / ".dvc" / "tmp"
    removed: list[str] = []
    rwlock = tmp / "rwlock"
    if rwlock.is_file():
        with _flock(tmp / "rwlock.lock"):
            try:
                lock = json.loads(rwlock.read_text() or "{}")
            except ValueError:
                lock = None
            if isinstance(lock, dict):
                states: dict[int, str] = {}

                def stale(info: dict, path: str, mode: str) -> bool:
                    pid = int(info.get("pid", -1))
                    state = states.setdefault(pid, lock_holder_state(pid))
                    if state != "dvc":
                        removed.append(f"rwlock {mode} {path}: PID {pid} is {state} ({info.get('cmd', '?')!r})")
                    return state != "dvc"

                write = {p: i for p, i in lock.get("write", {}).items() if not stale(i, p, "write")}
                read = {
                    p: kept
                    for p, infos in lock.get("read", {}).items()
                    if (kept := [i for i in infos if not stale(i, p, "read")])
                }
                if removed:
                    rwlock.write_text(json.dumps({"write": write, "read": read}))
    for line in removed:
        log.warning("cleared stale DVC lock: %s", line)
    # every dvc run leaves `lock` behind with its PID (zc.lockfile never deletes it): routine, not a warning
    return removed + _clear_repo_lock(tmp / "lock")


def _clear_repo_lock(path: Path) -> list[str]:
    try:
        f = open(path, "r+")
    except FileNotFoundError:
        return []
    with f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return []  # held: a live process owns it
        text = f.read().strip()
        if not text.isdigit():
            return []  # not a zc.lockfile (hardlink lock) or being written: leave it
        pid = int(text)
        state = lock_holder_state(pid)
        if state == "dvc" and pid != os.getpid():
            return []  # a live dvc that has just opened it and is about to flock it
        path.unlink()
        return [f"lock: PID {pid} is {state} and holds no flock"]


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


def start_in_own_session(cmd: list[str], cwd: str | Path, env: dict[str, str]) -> subprocess.Popen:
    """Start ``cmd`` in ``cwd`` as the leader of a new session (so its whole group can be killed), with stdout
    and stderr merged into one line-buffered text pipe and no stdin."""
    return subprocess.Popen(
        cmd,
        cwd=str(cwd),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,
    )


def stream_lines(proc: subprocess.Popen, thread_name: str | None = None) -> queue.Queue[str | None]:
    """A queue that a daemon thread fills with each output line of ``proc`` (newline stripped), then ``None``."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=pump, name=thread_name, daemon=True).start()
    return lines


def _status_after(line: str, stage: str, status: str) -> str:
    """The stage's status once DVC has logged ``line``: ``ran``, ``restored``, or ``status`` unchanged."""
    if _RAN.format(stage) in line:
        return "ran"
    if _RESTORED.format(stage) in line:
        return "restored"
    return status


def _follow_output(
    stage: str,
    lines: queue.Queue[str | None],
    log_line: Callable[[str], None],
    deadline: float | None,
    tail: collections.deque[str],
) -> str | None:
    """Pass each output line to ``log_line`` (and ``tail``) until the output ends.

    Returns the stage's status (``ran``, ``restored`` or ``skipped``), or ``None`` if ``deadline`` passed first.
    """
    status = "skipped"
    while True:
        if deadline is not None and time.monotonic() > deadline:
            return None
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            return status
        tail.append(line)
        log_line(line)
        status = _status_after(line, stage, status)


def run_dvc_stage(
    root: str | Path,
    stage: str,
    *,
    log_line: Callable[[str], None] = print,
    timeout_s: float | None = None,
    force: bool = False,
) -> StageOutcome:
    """``dvc repro --single-item <stage>`` (``--force`` with ``force``: run it even if unchanged) in ``root``;
    stream each output line to ``log_line``.

    Raises :class:`StageFailed` with the last lines of output on a non-zero exit or a timeout.
    """
    cmd = [sys.executable, "-m", "dvc", "repro", *(["--force"] if force else []), "--single-item", stage]
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    clear_stale_locks(root)
    proc = start_in_own_session(cmd, root, stage_env())
    lines = stream_lines(proc, thread_name=f"dvc-{stage}")
    try:
        status = _follow_output(stage, lines, log_line, deadline, tail)
        if status is None:
            kill_group(proc)
            raise StageFailed(f"stage {stage} timed out after {timeout_s:g} s; last output:\n" + "\n".join(tail))
        rc = proc.wait()
    except BaseException:
        # cancel, TerminationSignal, KeyboardInterrupt, timeout: take the whole group down
        if proc.poll() is None:
            kill_group(proc)
        raise
    if rc != 0:
        raise StageFailed(f"dvc repro --single-item {stage} exited {rc}; last output:\n" + "\n".join(tail))
    return StageOutcome(stage=stage, status=status, seconds=round(time.monotonic() - start, 2))
