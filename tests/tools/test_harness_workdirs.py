"""The kill and chaos harnesses delete only what they made (issue 55's audit of deleting call sites): a temp
workdir of their own at the end, never a ``--workdir`` the user gave; the chaos harness's reset removes only its
phase's run dir, checkpoint and metrics inside its own clone."""

from __future__ import annotations

import pytest

from tools import chaos_harness, kill_harness


def _stop(*args, **kwargs):
    raise RuntimeError("stopped before any project is built")


@pytest.mark.parametrize(("harness", "step"), [(chaos_harness, "prepare"), (kill_harness, "reference")])
def test_a_given_workdir_is_kept_and_a_temp_one_removed(harness, step, tmp_path, monkeypatch):
    monkeypatch.setattr(harness, step, _stop)
    given = tmp_path / "given"
    given.mkdir()
    (given / "notes.txt").write_text("the user's")
    with pytest.raises(RuntimeError, match="stopped before"):
        harness.main(["--workdir", str(given)])
    assert (given / "notes.txt").read_text() == "the user's"
    made = tmp_path / "made"
    monkeypatch.setattr(harness.tempfile, "mkdtemp", lambda prefix: str(made))
    with pytest.raises(RuntimeError, match="stopped before"):
        harness.main([])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["given"]  # its own temp workdir went


def test_the_chaos_reset_removes_its_phase_only(tmp_path):
    phase = chaos_harness.PHASE
    for folder in (f"runs/{phase}", f"checkpoints/{phase}", "checkpoints/scratch", "runs/other", "metrics/train"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "file").write_text("x")
    (tmp_path / f"metrics/train/{phase}.json").write_text("{}")
    chaos_harness._reset(tmp_path)
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("file"))
    assert left == ["checkpoints/scratch/file", "metrics/train/file", "runs/other/file"]
    assert not (tmp_path / f"metrics/train/{phase}.json").exists()
