"""``train.parallel``: what ``auto`` picks and why, what ``fsdp`` refuses by name, and the checkpoint state's split
into shards and the rest (the sharded runs themselves: tests/stages/test_train_fsdp.py)."""

from __future__ import annotations

import logging
import socket
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from sdforge.config import parse_params
from sdforge.io import InputError
from sdforge.training.distributed import Dist
from sdforge.training.parallel import STATE_BYTES_PER_PARAM, choose_sharding, require_shared_folder
from sdforge.training.sharded_state import PLACEHOLDER, live_keys, load_shards, save_shards, split_shards
from tests.fixtures.training import REPO

CUDA = Dist(rank=0, world=2, local_rank=0, device=torch.device("cuda", 0))
GIB = 2**30


@pytest.fixture
def card(monkeypatch):
    """A pretend CUDA card of 32 GiB (no GPU needed: ``auto`` reads only its total memory)."""
    props = SimpleNamespace(total_memory=32 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    return props


def test_explicit_settings_are_taken_as_they_are(card):
    assert choose_sharding("fsdp", 10, CUDA, []) is True
    assert choose_sharding("ddp", 10**10, CUDA, []) is False


def test_auto_replicates_on_a_cpu_and_on_one_process(card, caplog):
    caplog.set_level(logging.INFO)
    big = 10**10
    assert choose_sharding("auto", big, Dist(0, 2, 0, torch.device("cpu")), []) is False
    assert choose_sharding("auto", big, Dist(0, 1, 0, torch.device("cuda", 0)), []) is False
    assert "a CPU run" in caplog.text and "one process" in caplog.text


def test_auto_shards_once_the_replicated_state_takes_over_half_the_card(card, caplog):
    caplog.set_level(logging.INFO)
    half = 16 * GIB // STATE_BYTES_PER_PARAM  # parameters whose replicated state is exactly half of 32 GiB
    assert choose_sharding("auto", half, CUDA, []) is False
    assert choose_sharding("auto", half + 1000, CUDA, []) is True
    assert "auto: fsdp (the replicated state, 16.0 GiB, would take 50 % of the 32-GiB card" in caplog.text


def test_auto_falls_back_to_ddp_with_the_blocking_keys_named(card, caplog):
    assert choose_sharding("auto", 10**10, CUDA, ["phases.phase8.adapter"]) is False
    assert "fsdp does not support phases.phase8.adapter yet" in caplog.text


def test_fsdp_refuses_a_phase_it_does_not_support_by_key():
    """The demo's phase 8 (an adapter learning words) and phase 9 (distillation) are named; the params themselves
    load (other phases may shard), and phases 1 (post-hoc EMA) and 2 have nothing in the way."""
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["train"]["parallel"] = "fsdp"
    params = parse_params(data)
    assert params.fsdp_blockers("phase2") == params.fsdp_blockers("phase1") == []  # phase 1's post-hoc EMA shards
    for phase, key in (("phase8", "phases.phase8.adapter"), ("phase9", "phases.phase9.distill")):
        blockers = params.fsdp_blockers(phase)
        assert any(b.startswith(key) for b in blockers), blockers
        with pytest.raises(InputError, match=key.replace(".", r"\.")):
            choose_sharding("fsdp", 10, CUDA, blockers)


@pytest.fixture
def one_rank_group():
    """A process group of this process alone (gloo), torn down after the test."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    torch.distributed.destroy_process_group()


def _target(mesh, sharded: bool) -> torch.Tensor:
    """A zero 3×2 tensor to read into: a shard of one, or a whole one."""
    zeros = torch.zeros(3, 2)
    return distribute_tensor(zeros, mesh, [Shard(0)]) if sharded else zeros


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@pytest.mark.parametrize("sharded", [True, False], ids=["into-shards", "into-whole-tensors"])
def test_sharded_state_round_trips_through_dcp(one_rank_group, tmp_path, sharded):
    """``DTensor`` leaves become placeholders keyed by their path, the rest stays in the state; reading the folder
    back fills the placeholders from this run's tensors at the same places (shards or whole tensors) and the live
    weights in place."""
    mesh, moments = one_rank_group, torch.arange(6.0).reshape(3, 2)
    shard = lambda t: distribute_tensor(t, mesh, [Shard(0)])  # noqa: E731
    step = torch.tensor(3.0)
    state = {"optimizer": {"state": {0: {"step": step, "exp_avg": shard(moments)}}},
             "ema": {"shadow_params": [shard(moments + 1)], "decay": 0.99}}  # fmt: skip
    kept, flat = split_shards(state)
    assert set(flat) == {"/optimizer/state/0/exp_avg", "/ema/shadow_params/0"}
    assert kept["optimizer"]["state"][0] == {"step": step, "exp_avg": {PLACEHOLDER: "/optimizer/state/0/exp_avg"}}
    save_shards({**flat, **live_keys({"w": shard(moments * 2)})}, tmp_path / "sharded")
    current = {"optimizer": {"state": {0: {"step": torch.tensor(0.0), "exp_avg": _target(mesh, sharded)}}},
               "ema": {"shadow_params": [_target(mesh, sharded)], "decay": 0.5}}  # fmt: skip
    live = {"w": _target(mesh, sharded)}
    filled = load_shards(kept, current, live, tmp_path / "sharded")
    assert torch.equal(_whole(filled["optimizer"]["state"][0]["exp_avg"]), moments)
    assert torch.equal(_whole(filled["ema"]["shadow_params"][0]), moments + 1)
    assert torch.equal(_whole(live["w"]), moments * 2)  # read in place
    assert filled["ema"]["decay"] == 0.99 and float(filled["optimizer"]["state"][0]["step"]) == 3.0


@pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it after `make test`)
def test_a_sharded_run_needs_one_run_dir_every_rank_sees(tmp_path):
    """2 gloo ranks, each given its own folder (what two nodes with their own disks see): every rank gets the error
    naming rank 1 and what to do. (One shared folder passes in every sharded stage test, which leave no probe.)"""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, port = ctx.SimpleQueue(), _free_port()
    folders = [tmp_path / "node0/runs", tmp_path / "node1/runs"]
    procs = [ctx.Process(target=_probing_rank, args=(r, port, folders[r], queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    results = dict(queue.get() for _ in range(2))
    assert sorted(results) == [0, 1]
    assert all(f"rank(s) 1 on {socket.gethostname()} do not see it" in r for r in results.values()), results
    assert all("cluster.work_pvc" in r and "train.parallel: ddp" in r for r in results.values())
    assert list((tmp_path / "node0/runs").iterdir()) == []  # the main rank's probe removed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probing_rank(rank: int, port: int, folder, queue) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        require_shared_folder(folder, Dist(rank, 2, rank, torch.device("cpu")))
        queue.put((rank, "ok"))
    except InputError as err:
        queue.put((rank, str(err)))
    finally:
        torch.distributed.destroy_process_group()
