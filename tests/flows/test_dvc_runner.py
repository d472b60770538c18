"""flows.dvc_ops.runner: the stage runs in its own process group, and stale DVC locks left by a kill are cleared.

Real ``dvc`` on a two-stage project in a tmp dir. The rwlock entries are written the way
``dvc/rwlock.py`` writes them (``{"write": {abs path: {"pid", "cmd"}}, "read": {...}}``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flows.dvc_ops.runner import StageFailed, clear_stale_locks, lock_holder_state, run_dvc_stage, stage_env

HOLD = "import os, pathlib, time; pathlib.Path('hold.pid').write_text(str(os.getpid())); time.sleep(60)"
DVC_YAML = textwrap.dedent(f"""\
    stages:
      quick:
        cmd: echo quick > quick.txt
        outs: [quick.txt]
      hold:
        cmd: python -c "{HOLD}" && echo held > held.txt
        outs: [held.txt]
""")


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=tmp_path, check=True, env=stage_env())
    (tmp_path / ".dvc" / "tmp").mkdir(exist_ok=True)
    return tmp_path


def _dvc_repro(project: Path, stage: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", "repro", "--single-item", stage], cwd=project,
                          env=stage_env(), capture_output=True, text=True, timeout=120)


def _write_rwlock(project: Path, pid: int, path: str = "quick.txt", mode: str = "write") -> None:
    info = {"pid": pid, "cmd": "dvc repro --single-item quick"}
    target = str(project / path)
    lock = {"write": {target: info}, "read": {}} if mode == "write" else {"write": {}, "read": {target: [info]}}
    (project / ".dvc/tmp/rwlock").write_text(json.dumps(lock))


def _rwlock(project: Path) -> dict:
    return json.loads((project / ".dvc/tmp/rwlock").read_text())


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    return lock_holder_state(pid) not in ("dead", "zombie")


@pytest.mark.parametrize("mode", ["write", "read"])
def test_entry_of_a_dead_pid_is_cleared(project, mode):
    pid = _dead_pid()
    _write_rwlock(project, pid, mode=mode)
    removed = clear_stale_locks(project)
    assert len(removed) == 1 and f"PID {pid} is dead" in removed[0]
    assert _rwlock(project) == {"write": {}, "read": {}}


def test_a_reused_pid_blocks_dvc_until_cleared(project):
    """A PID reused by another program: DVC sees it alive and refuses; the runner clears it and runs."""
    other = subprocess.Popen(["sleep", "60"])
    try:
        _write_rwlock(project, other.pid)
        assert lock_holder_state(other.pid) == "other"
        refused = _dvc_repro(project, "quick")
        assert refused.returncode != 0 and "is busy" in refused.stdout + refused.stderr
        outcome = run_dvc_stage(project, "quick", log_line=lambda _: None)
        assert outcome.status == "ran" and (project / "quick.txt").is_file()
        assert _alive(other.pid)  # only its lock entry was removed
    finally:
        other.kill()
        other.wait()


def test_a_zombie_holder_blocks_dvc_until_cleared(project):
    """A killed ``dvc`` that nobody reaped is a zombie: psutil (and DVC) think it exists."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while lock_holder_state(zombie.pid) != "zombie":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    try:
        _write_rwlock(project, zombie.pid)
        refused = _dvc_repro(project, "quick")
        assert refused.returncode != 0 and "is busy" in refused.stdout + refused.stderr
        removed = [line for line in clear_stale_locks(project) if line.startswith("rwlock")]
        assert len(removed) == 1 and f"PID {zombie.pid} is zombie" in removed[0]
        assert _dvc_repro(project, "quick").returncode == 0
    finally:
        zombie.wait()


def test_live_dvc_holder_is_kept_then_cleared_once_killed(project):
    """A running ``dvc repro``'s entries and repo lock stay; after a SIGKILL of its group (unreaped) they go."""
    dvc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "--single-item", "hold"], cwd=project,
                           env=stage_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        _wait_for(project / "hold.pid")
        before = _rwlock(project)
        assert str(dvc.pid) in json.dumps(before) and lock_holder_state(dvc.pid) == "dvc"
        assert clear_stale_locks(project) == []
        assert _rwlock(project) == before
        assert (project / ".dvc/tmp/lock").is_file()  # dvc repro holds the repo lock while the stage runs
        os.killpg(dvc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while lock_holder_state(dvc.pid) != "zombie":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        removed = clear_stale_locks(project)
        assert removed and all(f"PID {dvc.pid} is zombie" in line for line in removed)  # rwlock entries + lock
        assert not (project / ".dvc/tmp/lock").exists()
        stage_pid = int((project / "hold.pid").read_text())
        while _alive(stage_pid):  # the stage dies with its group (SIGKILL lands once it leaves a syscall)
            assert time.monotonic() < deadline, f"stage PID {stage_pid} survived its group's SIGKILL"
            time.sleep(0.05)
    finally:
        if dvc.poll() is None:
            os.killpg(dvc.pid, signal.SIGKILL)
        dvc.wait()
    assert _rwlock(project) == {"write": {}, "read": {}}


def test_repo_lock_file_cleared_when_its_holder_is_dead_and_kept_when_held(project):
    import zc.lockfile

    lock = project / ".dvc/tmp/lock"
    lock.write_text(f" {_dead_pid()}\n")
    assert [line.startswith("lock: PID") for line in clear_stale_locks(project)] == [True]
    assert not lock.exists()
    held = zc.lockfile.LockFile(str(lock))  # flock held (by this process, as a live dvc would)
    try:
        assert clear_stale_locks(project) == [] and lock.is_file()
    finally:
        held.close()


def test_timeout_kills_the_stage_with_its_dvc(project):
    """The stage command runs in dvc's process group, which the runner kills on timeout: nothing is orphaned."""
    with pytest.raises(StageFailed, match="timed out"):
        run_dvc_stage(project, "hold", log_line=lambda _: None, timeout_s=12)
    stage_pid = int((project / "hold.pid").read_text())
    deadline = time.monotonic() + 10
    while _alive(stage_pid):
        assert time.monotonic() < deadline, "the stage command outlived its dvc"
        time.sleep(0.05)


def test_force_reruns_an_unchanged_stage_and_a_forced_timeout_keeps_the_output_tail(project):
    """``force=True`` is ``dvc repro --force``: an up-to-date stage runs again; killed on timeout, the error
    still ends with the stage's last output lines (a hung forced stage must say where it hung)."""
    assert run_dvc_stage(project, "quick", log_line=lambda _: None).status == "ran"
    assert run_dvc_stage(project, "quick", log_line=lambda _: None).status == "skipped"
    assert run_dvc_stage(project, "quick", log_line=lambda _: None, force=True).status == "ran"
    with pytest.raises(StageFailed, match="timed out") as failed:
        run_dvc_stage(project, "hold", log_line=lambda _: None, timeout_s=12, force=True)
    assert "Running stage 'hold'" in str(failed.value)
