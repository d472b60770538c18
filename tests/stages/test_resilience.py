"""Issue 22 through the train stage's CLI on the tiny workspace (48 samples, 16 per step, 3 steps per epoch × 2):
a preemption checkpoint on SIGTERM, resume on another world size, the pre-step-0 rank check, the hang watchdog,
and the sample ledger that proves each sample trained exactly once per epoch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import torch
import yaml

from model.diffusion import lr_at
from sdforge.training.exits import HUNG, PREEMPTED
from sdforge.training.reporting import read_steps
from tests.fixtures.training import REPO, clone_workspace, edit_params, train, untrained_clone, weights

MAX_ABS_DIFF = 1e-5
"""As tests/sdforge/training/test_ddp.py: after a world-size change only float32 summation order differs."""
MAX_ABS_DIFF_ACCUM = 1e-4
"""When the whole run also accumulates differently (4 micro-batches of 4 vs 2 of 8): the gradient's float32
sum differs more, and Adam turns that into full-size differences on weights whose gradients are near zero.
Measured 1.46e-5 (weights move ~1e-3 from init)."""


def _set(params: Path, **train_keys) -> None:
    data = yaml.safe_load(params.read_text())
    data["train"].update(train_keys)
    params.write_text(yaml.safe_dump(data))


def _metrics(root: Path) -> dict:
    return json.loads((root / "metrics/train/phase1.json").read_text())


def _assert_exactly_once(root: Path, steps: int = 6, global_batch: int = 16) -> None:
    m = _metrics(root)
    assert (m["ledger.duplicates"], m["ledger.missing"], m["ledger.unplanned"]) == (0, 0, 0), m
    assert m["ledger.samples"] == steps * global_batch
    ledger = pl.read_parquet(root / "checkpoints/phase1/ledger.parquet")
    assert ledger.height == steps * global_batch
    assert ledger.group_by("step").len()["len"].to_list() == [global_batch] * steps
    for epoch in (0, 1):
        positions = ledger.filter(pl.col("epoch") == epoch)["position"]
        assert positions.n_unique() == positions.len() == 3 * global_batch
    counts = dict(ledger.group_by("source").len().iter_rows())
    assert {k: m[f"source.{k}.samples"] for k in counts} == counts  # the metrics' per-source counts are the ledger's
    assert m["source.laion.share"] == 1.0 and m["source.laion.planned_share"] == 1.0


@pytest.fixture(scope="module")
def straight(straight_phase1):
    """The phase trained uninterrupted by one process (the reference)."""
    return straight_phase1


def _same_weights(a: Path, b: Path, tol: float = 0.0) -> float:
    worst = 0.0
    for sub in ("unet", "unet_ema"):
        x, y = weights(a, "phase1", sub), weights(b, "phase1", sub)
        worst = max(worst, max(float((x[k].double() - y[k].double()).abs().max()) for k in x))
    assert worst <= tol, f"weights differ by {worst:.3g} > {tol}"
    return worst


def _train_runs(root: Path) -> list:
    """The MLflow ``train`` runs of the workspace at ``root``, oldest first."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sdforge")
    return client.search_runs([exp.experiment_id], "tags.`sdforge.stage` = 'train'", order_by=["attributes.start_time"])


def test_sigterm_checkpoints_at_the_next_step_boundary_and_resumes_bit_identically(straight, fresh_workspace, tmp_path):
    params = fresh_workspace
    stopped = train(params, "phase1", env={"SDFORGE_TERM_AT_STEP": "4"})  # SIGTERM arrives between steps 4 and 5
    assert stopped.returncode == PREEMPTED, stopped.stderr[-3000:]
    assert "preempted at step 5: checkpoint checkpoint-00000005" in stopped.stderr
    assert (tmp_path / "runs/phase1/checkpoint-00000005/COMPLETE").is_file()
    assert json.loads((tmp_path / "runs/phase1/PREEMPTED.json").read_text())["step"] == 5
    resumed = train(params, "phase1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 5 (epoch 1, step 2 of it)" in resumed.stderr
    _same_weights(straight, tmp_path)
    _assert_exactly_once(tmp_path)
    # the preempted run's MLflow run says so (issue 37: it showed FINISHED); the resumed one finished
    preempted, finished = _train_runs(tmp_path)
    assert preempted.info.status == "KILLED" and finished.info.status == "FINISHED"
    assert preempted.data.tags["sdforge.end_reason"].startswith("Preempted: preempted at step 5: checkpoint")


def test_a_checkpoint_that_cannot_fit_the_grace_is_not_written(fresh_workspace, tmp_path):
    params = fresh_workspace
    _set(params, preempt_grace_s=1e-6)
    stopped = train(params, "phase1", env={"SDFORGE_TERM_AT_STEP": "1"})
    assert stopped.returncode == PREEMPTED
    assert "keeping the last good checkpoint" in stopped.stderr
    assert "preempted at step 2: no new checkpoint" in stopped.stderr
    assert not list((tmp_path / "runs/phase1").glob("checkpoint-*"))  # the first save was due at step 2


def test_sigterm_to_exit_seconds(fresh_workspace, tmp_path):
    """A real SIGTERM from outside: the stage exits with the preemption status; the seconds are printed
    (measured, not asserted)."""
    params = fresh_workspace
    env = {**os.environ, "SDFORGE_PROGRESS": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "stages.train", "--params", str(params), "--item", "phase1"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    steps = tmp_path / "runs/phase1/steps.jsonl"
    deadline = time.monotonic() + 240
    while (not steps.is_file() or not steps.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    print(f"SIGTERM to exit: {time.monotonic() - sent:.2f} s")
    assert proc.returncode == PREEMPTED, err[-3000:]


@pytest.fixture(scope="module")
def killed(straight, tmp_path_factory):
    """``killed(first, kill_at, accum, root)``: the tiny workspace trained with global batch 16 on ``first`` ranks
    (batch 16 // (first × ``accum``) per rank), SIGKILLed after step ``kill_at``, copied under ``root``; the copy's
    params file. Each such run trains once per module (the 1 → 2 and 1 → 3 rank tests start from the same one)."""
    runs: dict[tuple[int, int, int], Path] = {}

    def copy(first: int, kill_at: int, accum: int, root: Path) -> Path:
        if (first, kill_at, accum) not in runs:
            run = tmp_path_factory.mktemp(f"killed-{first}-{kill_at}-{accum}")
            params = untrained_clone(straight, run)
            edit_params(params, "phases.phase1", batch_size=16 // (first * accum), grad_accum=accum)
            _set(params, nproc_per_node=first)
            died = train(params, "phase1", kill_at=kill_at)
            assert died.returncode != 0
            runs[first, kill_at, accum] = run
        return clone_workspace(runs[first, kill_at, accum], root)

    return copy


def _resume_on(params: Path, then: int) -> subprocess.CompletedProcess:
    _set(params, nproc_per_node=then)
    return train(params, "phase1")


@pytest.mark.parametrize(
    ("first", "then", "kill_at", "accum"),
    # 2 → 1 is slow-only (issue 40: the suite's time): the default run keeps 1 → 2 here and a 2 → 1 resume in
    # test_a_run_killed_before_its_first_checkpoint_keeps_its_global_batch_on_another_world_size
    [pytest.param(2, 1, 4, 2, marks=pytest.mark.slow), (1, 2, 3, 4)],
)
@pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it after `make test`)
def test_resume_on_another_world_size_trains_every_sample_exactly_once(
    straight, killed, tmp_path, first, then, kill_at, accum
):
    """2 → 1 and 1 → 2 ranks (gloo): the global batch (16) is kept, the ledger is exactly-once, and the weights
    agree with the uninterrupted one-process run to the DDP tolerance (~30 s each with torchrun)."""
    resumed = _resume_on(killed(first, kill_at, accum, tmp_path), then)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming a checkpoint of {first} rank(s) on {then}: global batch 16 kept" in resumed.stderr
    _assert_exactly_once(tmp_path)
    print(f"{first} → {then} ranks: max |Δ weight| vs straight = {_same_weights(straight, tmp_path, MAX_ABS_DIFF):.3g}")


@pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it after `make test`)
def test_a_global_batch_the_new_world_cannot_split_is_a_named_error(killed, tmp_path):
    resumed = _resume_on(killed(1, 3, 4, tmp_path), 3)  # the 1 → 2 ranks test's killed run, resumed on 3
    assert resumed.returncode != 0  # every rank exits 2 with the message; torchrun reports 1
    assert "global batch is 16 samples per optimizer step, which 3 ranks cannot share evenly" in resumed.stderr
    assert "phases.phase1.batch_size" in resumed.stderr and "train.nproc_per_node" in resumed.stderr


@pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it after `make test`)
def test_a_rank_planning_other_batches_is_caught_before_step_0(fresh_workspace, tmp_path):
    params = fresh_workspace
    _set(params, nproc_per_node=2)
    done = train(params, "phase1", env={"SDFORGE_FAULT_EXTRA_BATCH_RANK": "1"})
    assert done.returncode != 0
    assert "ranks disagree before step 0" in done.stderr
    assert "micro_batches_per_epoch differs on rank(s) 1 (rank 0: [2, 2]; rank 1: [3, 2])" in done.stderr
    steps = tmp_path / "runs/phase1/steps.jsonl"
    assert not steps.is_file() or not steps.read_text()  # no step was trained


@pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it after `make test`)
def test_a_stuck_rank_trips_the_watchdog_with_stacks_in_the_log(fresh_workspace, tmp_path):
    params = fresh_workspace
    data = yaml.safe_load(params.read_text())
    data["phases"]["phase1"]["batch_size"] = 4  # 2 ranks × 4 × accum 2: 3 steps per epoch, step 1 saves nothing
    params.write_text(yaml.safe_dump(data))
    _set(params, nproc_per_node=2, hang_timeout_s=4)
    t0 = time.monotonic()
    done = train(params, "phase1", env={"SDFORGE_HANG_AT_STEP": "1", "SDFORGE_HANG_RANK": "1"})
    took = time.monotonic() - t0
    assert done.returncode == HUNG, done.stderr[-4000:]
    assert "hang watchdog (rank " in done.stderr and "no progress for" in done.stderr
    assert "lagging: rank(s) 1 (rank(s) 0 wait for them after step 1)" in done.stderr
    assert "Python stacks of every thread" in done.stderr and "in _hang_point" in done.stderr  # rank 1's own stack
    assert json.loads((tmp_path / "runs/phase1/HUNG.json").read_text())["step"] == 1
    (run,) = _train_runs(tmp_path)  # rank 0's: ended by its watchdog, or by the error its collective then raised
    assert run.info.status in ("KILLED", "FAILED") and run.data.tags["sdforge.end_reason"], run.info
    print(f"watchdog: the stage failed {took:.0f} s after it started (timeout 4 s); MLflow: {run.info.status}")


def test_the_split_prefers_the_configured_micro_batch():
    from sdforge.latents.bucket_batches import BatchSplit
    from sdforge.training.elastic import SplitError, choose_split

    assert choose_split(256, 32, 8, "p") == BatchSplit(32, 1, 8)
    assert choose_split(256, 32, 4, "p") == BatchSplit(32, 2, 4)  # fewer GPUs: more accumulation
    assert choose_split(256, 32, 16, "p") == BatchSplit(16, 1, 16)  # more GPUs: smaller micro-batches
    assert choose_split(48, 32, 1, "p") == BatchSplit(24, 2, 1)  # never more than batch_size per rank
    with pytest.raises(SplitError, match=r"256 is not a multiple of 3.*\b1, 2, 4, 8, 16, 32, 64\b"):
        choose_split(256, 32, 3, "p")


@pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it after `make test`)
def test_ranks_that_disagree_are_named_on_every_rank():
    """The check itself on a real 2-process gloo group."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_disagreeing_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    results = sorted(queue.get() for _ in range(2))
    want = "micro_batches_per_epoch differs on rank(s) 1 (rank 0: [5, 5]; rank 1: [5, 6])"
    assert all(want in r[1] for r in results)
    assert all("data differs" not in r[1] for r in results)  # only what differs is named


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _disagreeing_rank(rank: int, port: int, queue) -> None:
    from sdforge.training.distributed import Dist
    from sdforge.training.watchdog import RankMismatch, check_ranks_agree

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        facts = {"micro_batches_per_epoch": [5, 5 + rank], "data": "x"}
        check_ranks_agree(Dist(rank, 2, rank, torch.device("cpu")), facts)
        queue.put((rank, "no error"))
    except RankMismatch as err:
        queue.put((rank, str(err)))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it after `make test`)
def test_a_run_killed_before_its_first_checkpoint_keeps_its_global_batch_on_another_world_size(
    straight, killed, tmp_path
):
    """2 ranks × 4 × accum 2 (global 16), SIGKILLed at step 1 (no checkpoint yet), rerun on 1 process: the run dir's
    record keeps 16 (one process would otherwise start with 4 × 2 = 8), so it trains like the reference."""
    resumed = _resume_on(killed(2, 1, 2, tmp_path), 1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "started with global batch 16: keeping it on 1 rank(s)" in resumed.stderr
    assert _metrics(tmp_path)["global_batch"] == 16
    # the LR schedule rebuilt for the kept global batch has the phase's own peak and floor (issue 37: it took the
    # warm-up's first LR as its peak and ended at 1e-4 × peak)
    logged = [r["lr"] for r in read_steps(tmp_path / "runs/phase1").values()]
    assert logged == pytest.approx([lr_at(step, 1e-3, 2, 6) for step in range(1, 7)], rel=1e-9)
    _assert_exactly_once(tmp_path)
    print(f"max |Δ weight| vs straight = {_same_weights(straight, tmp_path, MAX_ABS_DIFF_ACCUM):.3g}")
