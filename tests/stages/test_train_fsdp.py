"""``train.parallel: fsdp`` (FSDP2 on gloo, CPU): 2 sharded ranks train like one replicated process with the same
global batch; a SIGKILL resumes bit for bit; a run killed at 2 ranks resumes at 3 with every sample seen once; a kill
inside a sharded write resumes from the previous checkpoint.

The phase: global batch 24 (1 process: 12 × accumulation 2; 2 ranks: 6 × 2; 3 ranks: 4 × 2), 48 samples → 2 steps
per epoch, 10 epochs = 20 optimizer steps, a checkpoint every 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
import yaml

from tests.fixtures.training import DDP_MAX_ABS_DIFF, train, untrained_clone, weights

STEPS = 20


def _workspace(straight: Path, root: Path, parallel: str, nproc: int) -> Path:
    params = untrained_clone(straight, root)
    data = yaml.safe_load(params.read_text())
    # validation images every 5 steps: forwards without a backward on the EMA weights swapped in, on every rank of a
    # sharded run; FSDP2 once kept the root's gathered (EMA) weights for the next training step (model/sharding.py)
    data["train"].update(parallel=parallel, nproc_per_node=nproc, validation_every=5, validation_prompts=2)
    data["phases"]["phase1"].update(batch_size=24 // (2 * nproc), grad_accum=2, epochs=10)
    params.write_text(yaml.safe_dump(data))
    return params


def _metrics(root: Path) -> dict:
    return json.loads((root / "metrics/train/phase1.json").read_text())


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, straight_phase1):
    """One replicated process and two sharded ranks, each trained uninterrupted."""
    roots = {name: tmp_path_factory.mktemp(name) for name in ("one", "fsdp2")}
    done = {
        "one": train(_workspace(straight_phase1, roots["one"], "ddp", 1), "phase1"),
        "fsdp2": train(_workspace(straight_phase1, roots["fsdp2"], "fsdp", 2), "phase1"),
    }
    for name, run in done.items():
        assert run.returncode == 0, f"{name}: {run.stderr[-4000:]}"
    return roots, done


def test_two_sharded_ranks_train_like_one_process(runs):
    """The weights after 20 steps (live and EMA) agree with the replicated run to the DDP test's tolerance."""
    roots, done = runs
    assert "train.parallel: fsdp" in done["fsdp2"].stderr
    m_one, m_two = _metrics(roots["one"]), _metrics(roots["fsdp2"])
    assert m_one["steps"] == m_two["steps"] == STEPS
    assert (m_one["parallel"], m_two["parallel"], m_two["world_size"]) == ("ddp", "fsdp", 2)
    assert m_two["final_loss"] == pytest.approx(m_one["final_loss"], rel=1e-4)
    init = weights(roots["one"], "scratch", "unet")
    for sub in ("unet", "unet_ema"):
        diff = _max_diff(weights(roots["fsdp2"], "phase1", sub), weights(roots["one"], "phase1", sub))
        moved = _max_diff(weights(roots["one"], "phase1", sub), init)
        print(f"{sub}: max |fsdp 2 ranks - 1 process| = {diff:.3g} (largest change from init {moved:.3g})")
        assert moved > 1e-3 and diff <= DDP_MAX_ABS_DIFF, f"{sub}: sharded run differs by {diff:.3g}"


def test_a_sharded_checkpoint_is_dcp_files_under_its_manifest(runs):
    """Each kept checkpoint holds ``sharded/`` (one DCP file per rank and DCP's metadata), no ``unet/``, and its
    manifest hashes every shard file."""
    roots, _ = runs
    ckpts = sorted((roots["fsdp2"] / "runs/phase1").glob("checkpoint-*"))
    assert [c.name for c in ckpts] == ["checkpoint-00000018", "checkpoint-00000020"]  # keep_last 2 (+ best)
    for ckpt in ckpts:
        files = json.loads((ckpt / "COMPLETE").read_text())["files"]
        shards = sorted(f for f in files if f.startswith("sharded/"))
        assert shards == ["sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"]
        assert not (ckpt / "unet").exists()
        assert all(files[f]["size"] == (ckpt / f).stat().st_size > 0 for f in shards)
    assert not list((roots["fsdp2"] / "runs/phase1").glob("*.shards"))


def test_sigkill_then_resume_on_two_sharded_ranks_is_bit_identical(runs, straight_phase1, tmp_path):
    """Killed after step 7 (checkpoint 6 is the newest), resumed at the same world size: the uninterrupted sharded
    run's weights, bit for bit."""
    roots, _ = runs
    params = _workspace(straight_phase1, tmp_path, "fsdp", 2)
    died = train(params, "phase1", kill_at=7)
    assert died.returncode != 0 and not (tmp_path / "runs/phase1/checkpoint-00000008").exists()
    resumed = train(params, "phase1")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "at step 6 (" in resumed.stderr
    for sub in ("unet", "unet_ema"):
        a, b = weights(roots["fsdp2"], "phase1", sub), weights(tmp_path, "phase1", sub)
        assert all(torch.equal(a[k], b[k]) for k in a), f"{sub} differs after the resume"
    assert _metrics(tmp_path)["final_loss"] == _metrics(roots["fsdp2"])["final_loss"]


def test_a_run_killed_at_two_ranks_resumes_at_three_with_every_sample_once(runs, straight_phase1, tmp_path):
    """Killed at 2 sharded ranks after step 9, resumed on 3 (DCP reshards the weights, moments and EMA): the ledger
    holds every planned sample exactly once, and the weights stay within the DDP tolerance of 1 process."""
    roots, _ = runs
    params = _workspace(straight_phase1, tmp_path, "fsdp", 2)
    died = train(params, "phase1", kill_at=9)
    assert died.returncode != 0
    data = yaml.safe_load(params.read_text())
    data["train"]["nproc_per_node"] = 3
    params.write_text(yaml.safe_dump(data))
    resumed = train(params, "phase1")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "resuming a checkpoint of 2 rank(s) on 3" in resumed.stderr
    metrics = _metrics(tmp_path)
    assert (metrics["steps"], metrics["resumed_at_step"], metrics["world_size"]) == (STEPS, 8, 3)
    assert (metrics["ledger.duplicates"], metrics["ledger.missing"], metrics["ledger.unplanned"]) == (0, 0, 0)
    ledger = pq.read_table(tmp_path / "checkpoints/phase1/ledger.parquet")
    assert ledger.num_rows == STEPS * 24
    diff = _max_diff(weights(tmp_path, "phase1", "unet"), weights(roots["one"], "phase1", "unet"))
    assert diff <= DDP_MAX_ABS_DIFF, f"resharded run differs from one process by {diff:.3g}"


def test_a_kill_inside_a_sharded_write_resumes_from_the_previous_checkpoint(runs, straight_phase1, tmp_path):
    """Every rank killed once its shards of checkpoint 4 are staged: no checkpoint 4, the staging folder left; the
    rerun resumes from 2, removes the staging folder at its next write, and ends bit for bit as the uninterrupted
    run."""
    roots, _ = runs
    params = _workspace(straight_phase1, tmp_path, "fsdp", 2)
    died = train(params, "phase1", env={"SDFORGE_KILL_IN_SHARDS_AT_STEP": "4"})
    run_dir = tmp_path / "runs/phase1"
    assert died.returncode != 0 and not (run_dir / "checkpoint-00000004").exists(), died.stderr[-3000:]
    assert (run_dir / "checkpoint-00000004.shards").is_dir()
    resumed = train(params, "phase1")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "at step 2 (" in resumed.stderr
    assert not list(run_dir.glob("*.shards"))
    for sub in ("unet", "unet_ema"):
        a, b = weights(roots["fsdp2"], "phase1", sub), weights(tmp_path, "phase1", sub)
        assert all(torch.equal(a[k], b[k]) for k in a), f"{sub} differs after the resume"


def test_a_replicated_checkpoint_resumes_sharded_and_back(runs, straight_phase1, tmp_path):
    """``train.parallel`` changes the job's shape, not the run: a replicated run killed after step 5 resumes
    sharded on 2 ranks (its whole tensors cut into shards); killed again after step 13, it resumes replicated on one
    process (the shards read into whole tensors). The weights stay within the DDP tolerance of the straight run."""
    roots, _ = runs
    params = _workspace(straight_phase1, tmp_path, "ddp", 1)
    assert train(params, "phase1", kill_at=5).returncode != 0
    data = yaml.safe_load(params.read_text())
    for parallel, nproc, kill in (("fsdp", 2, 13), ("ddp", 1, None)):
        data["train"].update(parallel=parallel, nproc_per_node=nproc)
        params.write_text(yaml.safe_dump(data))
        done = train(params, "phase1", kill_at=kill)
        assert (done.returncode != 0) if kill else (done.returncode == 0), done.stderr[-4000:]
    assert _metrics(tmp_path)["steps"] == STEPS
    for sub in ("unet", "unet_ema"):
        diff = _max_diff(weights(tmp_path, "phase1", sub), weights(roots["one"], "phase1", sub))
        assert diff <= DDP_MAX_ABS_DIFF, f"{sub}: differs from the straight run by {diff:.3g}"
