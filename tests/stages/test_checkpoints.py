"""Checkpoints: atomic, pruned to keep_last, corrupt ones skipped with a fallback."""

import logging

import torch

from stages.checkpoints import Progress, checkpoint_dirs, load_state, newest_loadable, save_checkpoint


class _Weights:
    def save_pretrained(self, path, safe_serialization=True):
        path.mkdir(parents=True)
        (path / "w.bin").write_bytes(b"x")


def test_save_prunes_and_marks_complete(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, Progress(step=step, epoch=0, batch=step), _Weights(),
                        {"t": torch.tensor([step])}, keep_last=2)
    names = [p.name for p in checkpoint_dirs(tmp_path)]
    assert names == ["checkpoint-00000002", "checkpoint-00000003"]
    state = load_state(tmp_path / names[-1])
    assert state["progress"] == {"step": 3, "epoch": 0, "batch": 3} and state["t"].item() == 3
    assert not list(tmp_path.glob("*.tmp"))


def test_interrupted_write_is_ignored(tmp_path):
    save_checkpoint(tmp_path, Progress(step=1), _Weights(), {}, keep_last=3)
    half = tmp_path / "checkpoint-00000002.tmp"
    half.mkdir()
    no_marker = tmp_path / "checkpoint-00000003"
    no_marker.mkdir()
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-00000001"]


def test_corrupt_newest_falls_back_with_warning(tmp_path, caplog):
    save_checkpoint(tmp_path, Progress(step=1), _Weights(), {"v": 1}, keep_last=3)
    newest = save_checkpoint(tmp_path, Progress(step=2), _Weights(), {"v": 2}, keep_last=3)
    data = (newest / "state.pt").read_bytes()
    (newest / "state.pt").write_bytes(data[: len(data) // 2])  # truncated
    with caplog.at_level(logging.WARNING):
        ckpt, state = newest_loadable(tmp_path, load_state)
    assert ckpt.name == "checkpoint-00000001" and state["v"] == 1
    assert "checkpoint-00000002 is unreadable" in caplog.text
