"""The loop, its hooks and the checkpoint manager on a toy job (a linear model, the real optimization, train state,
checkpoint format and ledger): event order, checkpoint schedule, bit-identical resume, preemption, how a run's
end reaches every hook — in milliseconds, in process."""

from __future__ import annotations

import json
import shutil
import threading
import time

import pyarrow.parquet as pq
import pytest
import torch

from sdforge.config import Train
from sdforge.training import async_checkpoint, checkpoint_manager
from sdforge.training.async_checkpoint import HostBuffers, choose_async
from sdforge.training.checkpoint_manager import CheckpointManager
from sdforge.training.checkpoints import checkpoint_dirs
from sdforge.training.hooks import CheckpointHook, FaultInjectionHook, Hook, Hooks, LedgerHook, PreemptionHook
from sdforge.training.ledger import read_ledger
from sdforge.training.loop import train_loop
from sdforge.training.preemption import Preempted, PreemptionNotice
from tests.fixtures.toy_job import GLOBAL_BATCH, CrashAfter, ToyJob, toy_reader, toy_step


class Recorder(Hook):
    """Records every event it sees (with the step where there is one)."""

    def __init__(self):
        self.events: list = []

    def start(self, job):
        self.events.append("start")

    def before_step(self, job):
        self.events.append("before")

    def after_step(self, job, report):
        self.events.append(("after", report.step))

    def epoch_end(self, job):
        self.events.append(("epoch_end", job.state.progress.epoch))

    def end(self, job):
        self.events.append("end")

    def close(self, error):
        self.events.append(("close", type(error).__name__ if error else None))


def _train(job: ToyJob, hooks: list[Hook]) -> None:
    with Hooks(hooks).running() as running:
        train_loop(job, running, toy_step, toy_reader)


def _run(tmp_path, stop_at: int | None = None, job: ToyJob | None = None):
    """Train a toy job with checkpoints in ``tmp_path`` (resuming from the newest); the job and its manager."""
    job = job or ToyJob()
    manager = CheckpointManager(job, tmp_path, "fp")
    manager.restore_newest()
    hooks = [LedgerHook(), CheckpointHook(manager), CrashAfter(stop_at) if stop_at else None, FaultInjectionHook()]
    _train(job, [h for h in hooks if h])
    return job, manager


def test_hooks_see_every_event_in_order():
    rec = Recorder()
    _train(ToyJob(), [rec])
    steps = [("before", ("after", s)) for s in range(1, 7)]
    flat = [e for pair in steps for e in pair]
    want = ["start", *flat[:6], ("epoch_end", 1), *flat[6:], ("epoch_end", 2), "end", ("close", None)]
    assert [e if e != "before" else "before" for e in rec.events] == want


def test_checkpoints_every_save_steps_and_at_each_epoch_end(tmp_path):
    job, _ = _run(tmp_path)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == [f"checkpoint-0000000{s}" for s in (2, 3, 4, 6)]
    manifest = json.loads((tmp_path / "checkpoint-00000006/COMPLETE").read_text())
    assert (manifest["step"], manifest["epoch"], manifest["batch"], manifest["global_batch"]) == (6, 2, 0, 4)
    ledger = read_ledger(tmp_path, job.state.ledger_segments)
    assert ledger.num_rows == 6 * GLOBAL_BATCH and ledger["step"].to_pylist()[::GLOBAL_BATCH] == [1, 2, 3, 4, 5, 6]
    assert [e["name"] for e in manifest["ledger"]] == [e["name"] for e in job.state.ledger_segments]


@pytest.mark.parametrize("stop_at", [1, 3, 5])
def test_a_stopped_run_resumes_bit_identically(tmp_path, stop_at):
    """Stopped after step ``stop_at`` (before any checkpoint, right after an epoch end's, mid-epoch 2), then resumed
    by a fresh job (whose model starts elsewhere when there is a checkpoint to restore): weights, EMA, optimizer
    moments and the loss tail all equal the uninterrupted run's."""
    straight, _ = _run(tmp_path / "straight")
    with pytest.raises(RuntimeError, match=f"crashed after step {stop_at}"):
        _run(tmp_path / "resumed", stop_at=stop_at)
    resumed, manager = _run(tmp_path / "resumed", job=ToyJob(model_seed=int(stop_at >= 2)))
    assert resumed.state.progress == straight.state.progress
    for a, b in zip(straight.model.trainable, resumed.model.trainable, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(straight.optim.ema.shadow_params, resumed.optim.ema.shadow_params, strict=True):
        assert torch.equal(a, b)
    moments = [s["exp_avg_sq"] for s in straight.optim.optimizer.state_dict()["state"].values()]
    again = [s["exp_avg_sq"] for s in resumed.optim.optimizer.state_dict()["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(moments, again, strict=True))
    assert resumed.state.losses[-3:] == straight.state.losses[-3:]
    ledger = read_ledger(tmp_path / "resumed", resumed.state.ledger_segments)
    assert sorted(set(ledger["step"].to_pylist())) == [1, 2, 3, 4, 5, 6]  # every step once: none lost, none twice
    assert ledger.num_rows == 6 * GLOBAL_BATCH


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    with pytest.raises(RuntimeError):
        _run(tmp_path, stop_at=5)
    state = tmp_path / "checkpoint-00000004" / "state.pt"
    state.write_bytes(state.read_bytes()[:100])  # truncated
    job = ToyJob(model_seed=1)
    assert CheckpointManager(job, tmp_path, "fp").restore_newest() == tmp_path / "checkpoint-00000003"
    assert job.state.progress.step == 3


def test_a_checkpoint_of_another_global_batch_replans_the_job(tmp_path):
    with pytest.raises(RuntimeError):
        _run(tmp_path, stop_at=2)
    job = ToyJob()
    job.set_global_batch(8)
    CheckpointManager(job, tmp_path, "fp").restore_newest()
    assert job.plan.global_batch == GLOBAL_BATCH  # the run's own, from the checkpoint


def test_sigterm_stops_at_the_step_boundary_with_a_checkpoint(tmp_path):
    job, notice = ToyJob(), PreemptionNotice()
    try:
        manager = CheckpointManager(job, tmp_path, "fp")
        preemption = PreemptionHook(notice, manager, grace_s=60.0, run_dir=tmp_path)
        notice.received = time.monotonic()  # as if SIGTERM came before step 1
        with pytest.raises(Preempted) as stop:
            _train(job, [LedgerHook(), preemption, CheckpointHook(manager)])
    finally:
        notice.close()
    assert stop.value.step == 1 and stop.value.checkpoint == tmp_path / "checkpoint-00000001"
    assert json.loads((tmp_path / "PREEMPTED.json").read_text())["step"] == 1
    assert json.loads((tmp_path / "checkpoint-00000001/COMPLETE").read_text())["step"] == 1


def test_every_hook_is_closed_in_reverse_order_with_the_error():
    closed = []

    class Named(Hook):
        def __init__(self, name):
            self.name = name

        def close(self, error):
            closed.append((self.name, str(error)))

    with pytest.raises(RuntimeError, match="crashed after step 2"):
        _train(ToyJob(), [Named("first"), CrashAfter(2), Named("last")])
    assert closed == [("last", "crashed after step 2"), ("first", "crashed after step 2")]


def test_the_state_components_share_no_key_and_round_trip(tmp_path):
    job, manager = _run(tmp_path)
    state = manager.state_dict()
    assert set(state) == {"optimizer", "lr_scheduler", "ema", "recent_losses", "global_batch"}
    saved = torch.load(tmp_path / "checkpoint-00000006/state.pt", weights_only=True)
    assert saved["recent_losses"] == job.state.losses[-20:] and saved["progress"] == vars(job.state.progress)


def test_the_ledger_segment_is_written_before_the_checkpoint_that_lists_it(tmp_path):
    _run(tmp_path)
    shutil.rmtree(tmp_path / "checkpoint-00000006")
    manifest = json.loads((tmp_path / "checkpoint-00000004/COMPLETE").read_text())
    names = [e["name"] for e in manifest["ledger"]]
    assert names == ["00000001-00000002.parquet", "00000003-00000003.parquet", "00000004-00000004.parquet"]
    assert pq.read_table(tmp_path / "ledger" / names[-1]).num_rows == GLOBAL_BATCH


# -- checkpoints written in the background (train.async_checkpoint) ---------------------------------------------
def _async_job(setting: str = "on") -> ToyJob:
    return ToyJob(Train(save_steps=2, keep_last=10, log_every=1, ema_decay=0.9, async_checkpoint=setting))


def test_a_background_write_holds_the_step_only_for_its_snapshot(tmp_path, monkeypatch):
    monkeypatch.setenv("SDFORGE_SLOW_CHECKPOINT_S", "0.5")
    job = _async_job()
    manager = CheckpointManager(job, tmp_path, "fp")
    toy_step(job, toy_reader(job, 0))
    t0 = time.perf_counter()
    assert manager.save() is None  # written in the background
    stall = time.perf_counter() - t0
    assert stall < 0.5 and manager.asynchronous
    deadline = time.monotonic() + 0.4
    while not (tmp_path / "checkpoint-00000001.tmp").is_dir() and time.monotonic() < deadline:
        time.sleep(0.01)  # the writer thread starts
    assert checkpoint_dirs(tmp_path) == [] and (tmp_path / "checkpoint-00000001.tmp").is_dir()  # not complete yet
    toy_step(job, toy_reader(job, 0))  # training goes on while it is written: the snapshot is what is written
    assert manager.finish_writes() == tmp_path / "checkpoint-00000001"
    manager.close()
    restored = ToyJob(model_seed=1)
    CheckpointManager(restored, tmp_path, "fp").restore_newest()
    assert restored.state.progress.step == 1 and restored.state.losses == job.state.losses[:1]


@pytest.mark.parametrize("stop_at", [3, 5])
def test_background_checkpoints_resume_like_blocking_ones(tmp_path, stop_at):
    """A run stopped after ``stop_at`` and resumed, writing every checkpoint in the background, ends exactly as an
    uninterrupted run with blocking writes."""
    straight, _ = _run(tmp_path / "blocking", job=_async_job("off"))
    with pytest.raises(RuntimeError):
        _run(tmp_path / "async", stop_at=stop_at, job=_async_job("on"))
    resumed, manager = _run(tmp_path / "async", job=_async_job("on"))
    assert manager.asynchronous
    for a, b in zip(straight.model.trainable, resumed.model.trainable, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(straight.optim.ema.shadow_params, resumed.optim.ema.shadow_params, strict=True):
        assert torch.equal(a, b)
    blocking = torch.load(tmp_path / "blocking/checkpoint-00000006/state.pt", weights_only=True)
    background = torch.load(tmp_path / "async/checkpoint-00000006/state.pt", weights_only=True)
    assert torch.equal(blocking["ema"]["shadow_params"][0], background["ema"]["shadow_params"][0])
    assert blocking["progress"] == background["progress"] and blocking["recent_losses"] == background["recent_losses"]


def test_a_cpu_snapshot_is_copied_behind_the_next_step_and_its_update_waits_for_the_copy(tmp_path, monkeypatch):
    """On a CPU the writer thread copies the state while the next step computes; the step's optimizer update
    waits for that copy, so the checkpoint holds the state at the save, as a blocking write's does."""
    order: list[str] = []
    gates: list[threading.Event] = []

    def late_fill(pairs):  # the copy starts only once the test lets it (after the next step has begun)
        gates[-1].wait(10)
        async_checkpoint.fill(pairs)
        order.append("copied")

    monkeypatch.setattr(checkpoint_manager, "fill", late_fill)
    blocking, background = _async_job("off"), _async_job("on")
    for job, where in ((blocking, "blocking"), (background, "async")):
        job.optim.optimizer.register_step_pre_hook(lambda *_: order.append("update"))
        manager = CheckpointManager(job, tmp_path / where, "fp")
        toy_step(job, toy_reader(job, 0))
        order.clear()
        gates.append(threading.Event())
        written = manager.save()  # blocking: the checkpoint; in the background: None
        threading.Timer(0.2, gates[-1].set).start()
        toy_step(job, toy_reader(job, 0))  # its update must wait for the copy
        assert (written or manager.finish_writes()) == tmp_path / where / "checkpoint-00000001"
        manager.close()
    assert order == ["copied", "update"]  # the background run's: copy first, then the step's update
    assert background.optim.snapshot_read is None
    saved = [tmp_path / w / "checkpoint-00000001" for w in ("blocking", "async")]
    assert (saved[0] / "toy/w.safetensors").read_bytes() == (saved[1] / "toy/w.safetensors").read_bytes()
    a, b = (torch.load(f / "state.pt", weights_only=True) for f in saved)
    assert torch.equal(a["optimizer"]["state"][0]["exp_avg"], b["optimizer"]["state"][0]["exp_avg"])
    assert torch.equal(a["ema"]["shadow_params"][0], b["ema"]["shadow_params"][0])


def test_host_buffers_are_reused_and_keep_the_state_layout():
    buffers = HostBuffers(pinned=True)
    state = {"m": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last), "n": [torch.ones(3)], "k": 7}
    first = buffers.copy(state)
    assert first["k"] == 7 and torch.equal(first["m"], state["m"]) and first["m"].stride() == state["m"].stride()
    state["m"].add_(1)
    second = buffers.copy(state)
    assert second["m"] is first["m"] and torch.equal(second["m"], state["m"])  # the same buffer, refilled
    live = buffers.copy({"w": state["m"]}, "live", contiguous=True)
    assert live["w"].is_contiguous() and torch.equal(live["w"], state["m"])
    assert buffers.nbytes == 2 * state["m"].numel() * 4 + 3 * 4


def test_auto_writes_in_the_background_on_a_cpu_only_when_a_second_copy_fits(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(async_checkpoint, "memory_available", lambda: 20 * 2**30)
    assert choose_async("auto", cpu, 10 * 2**30)[0] is True
    on, why = choose_async("auto", cpu, 19 * 2**30)
    assert on is False and "does not fit in the 20.00 GiB free" in why
    assert choose_async("on", cpu, 19 * 2**30)[0] is True and choose_async("off", cpu, 1)[0] is False
    assert choose_async("auto", torch.device("cuda"), 10**12)[0] is True  # pinned buffers: not host RAM-bound
