"""Resume: a checkpoint counts only once restored in full (state, RNG, UNet, EMA) on every rank; any that fails is
skipped with a warning naming the file, for the next older one; none restoring fails the stage with a named error."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from sdforge.io import InputError
from sdforge.training.checkpoints import CheckpointError
from sdforge.training.resume import ResumeError, restore_newest
from tests.fixtures.checkpoints import save
from tests.fixtures.training import train, untrained_clone

UNPICKLABLE = Path("/not/a/tensor")  # a global outside torch's weights_only allowlist


def reseal(ckpt: Path) -> None:
    """Rewrite the ``COMPLETE`` manifest's file table so that it matches the files as they now are."""
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != "COMPLETE")
    manifest["files"] = {
        p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in files
    }
    (ckpt / "COMPLETE").write_text(json.dumps(manifest, indent=1) + "\n")


def pickle_unet(ckpt: Path) -> None:
    """Replace ``unet/``'s safetensors by a pickled ``.bin`` (plus a non-tensor object) under a matching manifest."""
    st = ckpt / "unet" / "diffusion_pytorch_model.safetensors"
    torch.save({**load_file(st), "extra": UNPICKLABLE}, st.with_suffix(".bin"))
    st.unlink()
    reseal(ckpt)


class Recorder:
    """A restore callable that records what it was given and fails for the steps in ``bad``."""

    def __init__(self, bad: set[int] = frozenset()):
        self.bad, self.calls = bad, []

    def __call__(self, ckpt: Path, state: dict) -> None:
        step = int(state["v"].item())
        self.calls.append(step)
        if step in self.bad:
            raise CheckpointError(f"{ckpt / 'unet'}: cannot load the UNet (broken {step})")


# -- unit: one process -----------------------------------------------------------------------
def test_a_checkpoint_that_fails_to_restore_falls_back_to_the_previous_one(tmp_path, caplog):
    for step in (1, 2, 3):
        save(tmp_path, step)
    restore = Recorder(bad={3})
    with caplog.at_level(logging.WARNING):
        ckpt = restore_newest(tmp_path, restore)
    assert ckpt == tmp_path / "checkpoint-00000002"
    assert restore.calls == [3, 2]
    assert "checkpoint-00000003 is unreadable" in caplog.text
    assert "checkpoint-00000003/unet: cannot load the UNet (broken 3)" in caplog.text


def test_pickled_state_is_refused_naming_the_file_and_never_suggesting_unpickling(tmp_path, caplog):
    save(tmp_path, 1)
    newest = save(tmp_path, 2)
    state = torch.load(newest / "state.pt", weights_only=True)
    torch.save({**state, "extra": UNPICKLABLE}, newest / "state.pt")
    reseal(newest)
    restore = Recorder()
    with caplog.at_level(logging.WARNING):
        assert restore_newest(tmp_path, restore) == tmp_path / "checkpoint-00000001"
    assert restore.calls == [1]
    assert f"{newest / 'state.pt'}: it holds pickled Python objects" in caplog.text
    assert "weights_only" not in caplog.text


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    assert restore_newest(tmp_path, Recorder()) is None
    assert restore_newest(tmp_path / "absent", Recorder()) is None


def test_none_restoring_is_a_named_error(tmp_path, caplog):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / "checkpoint-00000001" / "state.pt").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING), pytest.raises(ResumeError) as err:
        restore_newest(tmp_path, Recorder(bad={2}))
    assert isinstance(err.value, InputError)  # the stage CLI turns it into one line and status 2
    message = str(err.value)
    assert str(tmp_path) in message and "checkpoint-00000001" in message and "checkpoint-00000002" in message
    assert "\n" not in message
    assert "checkpoint-00000001 is unreadable" in caplog.text and "checkpoint-00000002 is unreadable" in caplog.text


# -- unit: two ranks (gloo) ------------------------------------------------------------------
def _rank(rank: int, port: int, run_dir: Path, bad_on_rank1: int, out: Path) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        restore = Recorder(bad={bad_on_rank1} if rank == 1 else set())
        ckpt = restore_newest(run_dir, restore, rank=rank, world=2)
        (out / f"rank{rank}.json").write_text(json.dumps({"ckpt": ckpt.name, "calls": restore.calls}))
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it after `make test`)
def test_a_failure_on_one_rank_moves_every_rank_to_the_previous_checkpoint(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    for step in (1, 2):
        save(run_dir, step, world=2)
    mp.spawn(_rank, args=(_free_port(), run_dir, 2, out), nprocs=2, join=True)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["ckpt"] for r in ranks] == ["checkpoint-00000001", "checkpoint-00000001"]
    assert ranks[0]["calls"] == [2, 1] and ranks[1]["calls"] == [2, 1]


# -- the train stage ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, straight_phase1):
    """phase1 of the tiny workspace SIGKILLed after step 5: checkpoints 3 and 4 are left in ``runs/phase1``."""
    root = tmp_path_factory.mktemp("resume")
    params = untrained_clone(straight_phase1, root)
    assert train(params, "phase1", kill_at=5).returncode == -9
    return root, params


def test_train_skips_a_checkpoint_whose_unet_is_a_pickle(killed_run):
    root, params = killed_run
    run_dir = root / "runs" / "phase1"
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-00000003", "checkpoint-00000004"]
    pickle_unet(run_dir / "checkpoint-00000004")
    resumed = train(params, "phase1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"checkpoint {run_dir / 'checkpoint-00000004'} is unreadable" in resumed.stderr
    assert f"{run_dir / 'checkpoint-00000004' / 'unet'}: no .safetensors weights" in resumed.stderr
    assert "at step 3 (" in resumed.stderr
    assert "weights_only" not in resumed.stderr
    metrics = json.loads((root / "metrics/train/phase1.json").read_text())
    assert metrics["resumed_at_step"] == 3 and metrics["steps"] == 6


def test_train_fails_with_one_line_when_no_checkpoint_restores(killed_run):
    root, params = killed_run
    run_dir = root / "runs" / "phase1"
    ckpts = sorted(run_dir.glob("checkpoint-*"))
    assert ckpts
    for ckpt in ckpts:
        if (ckpt / "unet" / "diffusion_pytorch_model.safetensors").is_file():
            pickle_unet(ckpt)
    failed = train(params, "phase1")
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert "Traceback" not in failed.stderr and "weights_only" not in failed.stderr
    last = failed.stderr.strip().splitlines()[-1]
    assert f"{run_dir}: none of its checkpoints can be resumed from" in last
    assert all(c.name in last for c in ckpts)
