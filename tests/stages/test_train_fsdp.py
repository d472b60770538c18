"""``train.parallel: fsdp`` (FSDP2 on gloo, CPU): 2 sharded ranks train like one replicated process with the same
global batch; a kill inside a (background) sharded write resumes from the previous checkpoint, and a SIGKILL resumes
bit for bit; a run resumes across ``train.parallel`` and world sizes (killed at 2 ranks, resumed at 3) with every
sample seen once. Each sequence of kills is one test: every rerun is a torchrun start (issue 40: the suite's time).

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

pytestmark = pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it)


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
    assert not list((roots["fsdp2"] / "runs/phase1").glob(".shared-probe-*"))  # the run-dir check's probe


def test_kills_inside_a_background_sharded_write_and_after_a_step_resume_bit_identically(
    runs, straight_phase1, tmp_path
):
    """On 2 sharded ranks writing their checkpoints in the background (``async_checkpoint: auto`` on a CPU with room):
    every rank SIGKILLed once its shards of checkpoint 4 are written, before the checkpoint exists (no checkpoint 4,
    its staging folder left); the rerun resumes from 2 (and removes the staging folder at its first write) and is
    SIGKILLed after step 7; the last rerun resumes from 6 and ends bit for bit as the uninterrupted sharded run."""
    roots, _ = runs
    params = _workspace(straight_phase1, tmp_path, "fsdp", 2)
    run_dir = tmp_path / "runs/phase1"
    died = train(params, "phase1", env={"SDFORGE_KILL_IN_SHARDS_AT_STEP": "4"})
    assert died.returncode != 0 and "checkpoints in the background" in died.stderr, died.stderr[-3000:]
    assert not (run_dir / "checkpoint-00000004").exists() and (run_dir / "checkpoint-00000004.shards").is_dir()
    died = train(params, "phase1", kill_at=7)
    assert died.returncode != 0 and "at step 2 (" in died.stderr, died.stderr[-3000:]
    assert not list(run_dir.glob("*.shards")) and not (run_dir / "checkpoint-00000008").exists()
    resumed = train(params, "phase1")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "at step 6 (" in resumed.stderr
    for sub in ("unet", "unet_ema"):
        a, b = weights(roots["fsdp2"], "phase1", sub), weights(tmp_path, "phase1", sub)
        assert all(torch.equal(a[k], b[k]) for k in a), f"{sub} differs after the resumes"
    assert _metrics(tmp_path)["final_loss"] == _metrics(roots["fsdp2"])["final_loss"]


def test_a_run_resumes_across_parallel_and_world_size_with_every_sample_once(runs, straight_phase1, tmp_path):
    """``train.parallel`` and the world size change the job's shape, not the run (blocking writes here): replicated
    on 1 process killed after step 5; sharded on 2 ranks (the whole tensors cut into shards) killed after step 9;
    sharded on 3 (DCP reshards weights, moments and EMA) killed after step 13; replicated on 1 (the shards read into
    whole tensors) to the end. The ledger holds every planned sample exactly once, and the weights stay within the
    DDP tolerance of the straight run."""
    roots, _ = runs
    params = _workspace(straight_phase1, tmp_path, "ddp", 1)
    data = yaml.safe_load(params.read_text())
    data["train"]["async_checkpoint"] = "off"
    legs = (("ddp", 1, 5, None), ("fsdp", 2, 9, "at step 4 ("), ("fsdp", 3, 13, "of 2 rank(s) on 3"),
            ("ddp", 1, None, "of 3 rank(s) on 1"))  # fmt: skip
    for parallel, nproc, kill, says in legs:
        data["train"].update(parallel=parallel, nproc_per_node=nproc)
        params.write_text(yaml.safe_dump(data))
        done = train(params, "phase1", kill_at=kill)
        assert (done.returncode != 0) if kill else (done.returncode == 0), done.stderr[-4000:]
        assert says is None or says in done.stderr, (says, done.stderr[-3000:])
    metrics = _metrics(tmp_path)
    assert (metrics["steps"], metrics["resumed_at_step"], metrics["world_size"]) == (STEPS, 12, 1)
    assert (metrics["ledger.duplicates"], metrics["ledger.missing"], metrics["ledger.unplanned"]) == (0, 0, 0)
    assert pq.read_table(tmp_path / "checkpoints/phase1/ledger.parquet").num_rows == STEPS * 24
    for sub in ("unet", "unet_ema"):
        diff = _max_diff(weights(tmp_path, "phase1", sub), weights(roots["one"], "phase1", sub))
        assert diff <= DDP_MAX_ABS_DIFF, f"{sub}: differs from the straight run by {diff:.3g}"
