"""A checkpoint write that meets a full disk or a file-size limit is one line naming the file and the cause — on the
training thread and from the background writer alike — and the previous checkpoint stays intact and loadable
(docs/RESILIENCE.md, Write faults)."""

from __future__ import annotations

import errno
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from sdforge.training.async_checkpoint import BackgroundWriter
from sdforge.training.checkpoints import (
    Progress,
    Retention,
    checkpoint_dirs,
    load_state,
    save_checkpoint,
    verify_checkpoint,
)
from sdforge.training.ledger import write_segment
from tests.fixtures.checkpoints import FakeWeights, rank_rng, save
from tests.fixtures.demo_data import tree_digest
from tests.fixtures.write_faults import tmpfs

FULL_DISK = r"checkpoint-00000004\.tmp/state\.pt: cannot write a checkpoint file: no space left on device \(ENOSPC\)"


def torch_on_a_full_disk(obj, f, *args, **kwargs):
    """What ``torch.save`` into a Python file raises when the disk is full: its zip writer's RuntimeError, with
    the file's OSError as its context (torch 2.x)."""
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None


@pytest.fixture
def previous(tmp_path) -> tuple[Path, str]:
    """A run dir with a good checkpoint at step 2, and the digest of its files."""
    ckpt = save(tmp_path, 2, loss=0.5)
    return ckpt, tree_digest(ckpt)


def _assert_previous_intact(run_dir: Path, previous: tuple[Path, str]) -> None:
    ckpt, digest = previous
    assert checkpoint_dirs(run_dir) == [ckpt]
    assert tree_digest(ckpt) == digest
    verify_checkpoint(ckpt)
    assert load_state(ckpt)["progress"]["step"] == 2


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_previous_checkpoint_resumes(
    tmp_path, previous, monkeypatch
):
    monkeypatch.setattr(torch, "save", torch_on_a_full_disk)
    with pytest.raises(ValueError, match=FULL_DISK) as caught:
        save(tmp_path, 4, loss=0.4)
    message = str(caught.value)
    assert "\n" not in message and "point paths.runs elsewhere" in message
    assert message.endswith("the previous checkpoint (if any) is intact: a rerun resumes from it")
    _assert_previous_intact(tmp_path, previous)
    monkeypatch.undo()  # space back: the next save writes over the half-written temp folder
    assert save(tmp_path, 4, loss=0.4) == tmp_path / "checkpoint-00000004"
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-00000002", "checkpoint-00000004"]


def test_a_background_write_fault_reaches_the_training_thread_as_the_same_one_line(tmp_path, previous, monkeypatch):
    monkeypatch.setattr(torch, "save", torch_on_a_full_disk)
    writer = BackgroundWriter()
    writer.submit(lambda: save(tmp_path, 4, loss=0.4))
    with pytest.raises(ValueError, match=FULL_DISK) as caught:
        writer.wait()
    assert not str(caught.value).startswith("background checkpoint write failed")
    assert writer.wait() is None  # the error is handed over once
    _assert_previous_intact(tmp_path, previous)


def _save_big(run_dir: Path, step: int, numbers: int) -> Path:
    return save_checkpoint(
        run_dir,
        Progress(step=step, epoch=0, batch=step),
        lambda ckpt: FakeWeights(step).save_pretrained(ckpt / "unet"),
        {"v": torch.zeros(numbers)},
        Retention(keep_last=10),
        rng=[rank_rng(0)],
        loss=0.1,
    )


def test_a_real_full_disk_keeps_the_previous_checkpoint_and_space_back_lets_the_next_one_through(tmp_path):
    """ENOSPC from the kernel (a 1 MiB tmpfs holding one ~600 KiB checkpoint): torch's own error names no errno,
    the file object passed to it keeps it."""
    with tmpfs(tmp_path / "runs", "1m") as run_dir:
        first = _save_big(run_dir, 2, 150_000)
        digest = tree_digest(first)
        with pytest.raises(ValueError, match=FULL_DISK):
            _save_big(run_dir, 4, 150_000)
        assert checkpoint_dirs(run_dir) == [first] and tree_digest(first) == digest
        verify_checkpoint(first)
        done = subprocess.run(["mount", "-o", "remount,size=4m", str(run_dir)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert _save_big(run_dir, 4, 150_000) == run_dir / "checkpoint-00000004"
        assert load_state(run_dir / "checkpoint-00000004")["progress"]["step"] == 4


def test_a_ledger_segment_on_a_full_disk_is_named(tmp_path, monkeypatch):
    class Data:
        sources = ["laion"]
        source_code = np.zeros(4, np.int32)
        shard = np.zeros(4, np.int64)
        row = np.arange(4)

    records = [{
        "step": np.array([1, 1], np.int32), "epoch": np.zeros(2, np.int32), "rank": np.zeros(2, np.int16),
        "micro": np.zeros(2, np.int16), "position": np.array([0, 1], np.int32), "loss": np.ones(2, np.float32),
        "synthetic": np.zeros(2, bool),
    }]  # fmt: skip

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(pq, "write_table", full)
    with pytest.raises(ValueError, match=r"ledger/00000001-00000001\.parquet: cannot write the sample-ledger segment"):
        write_segment(tmp_path, records, Data(), 1, 1)
    assert not list((tmp_path / "ledger").glob("*.parquet"))
