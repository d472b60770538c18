"""sdforge.training.launch: the torchrun command line, "already a rank?" detection, exit status and signal forwarding.

The real 2-process run through the stage CLI is in ``tests/sdforge/training/test_ddp.py``
(``test_two_process_run_through_the_stage_cli``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from sdforge.config import Train
from sdforge.training import cli as training_cli
from sdforge.training.launch import launch, needs_launch, torchrun_command
from stages import train as train_stage
from tests.fixtures.training import run_node_agents

REPO = Path(__file__).resolve().parents[3]
ARGV = ["--params", "params.yaml", "--item", "phase1"]


def test_one_node_two_processes_is_standalone():
    cmd = torchrun_command(Train(nproc_per_node=2), ARGV)
    assert cmd == [
        sys.executable,
        *("-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1", "--node_rank", "0"),
        *("--shutdown_timeout", "35"),  # train.preempt_grace_s 25 + 10: torchrun waits for a preemption checkpoint
        "--standalone",
        *("-m", "stages.train", *ARGV),
    ]


def test_two_nodes_rendezvous_at_the_endpoint():
    cfg = Train(nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="node0.cluster:29400")
    cmd = torchrun_command(cfg, ARGV)
    assert cmd[1:] == [
        *("-m", "torch.distributed.run", "--nproc_per_node", "8", "--nnodes", "2", "--node_rank", "1"),
        *("--shutdown_timeout", "35"),
        *("--rdzv_backend", "c10d", "--rdzv_endpoint", "node0.cluster:29400"),
        *("-m", "stages.train", *ARGV),
    ]
    assert "--standalone" not in cmd


@pytest.mark.parametrize(
    ("cfg", "env", "expected"),
    [
        (Train(), {}, False),  # one process: train in-process
        (Train(nproc_per_node=2), {}, True),
        (Train(nnodes=2, rdzv_endpoint="h:1"), {}, True),
        (Train(nproc_per_node=2), {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, False),  # a torchrun rank
        (Train(nproc_per_node=2), {"LOCAL_RANK": "0"}, False),
    ],
)
def test_needs_launch(cfg, env, expected):
    assert needs_launch(cfg, env) is expected


def test_launch_returns_the_exit_status():
    assert launch([sys.executable, "-c", "pass"]) == 0
    assert launch([sys.executable, "-c", "import sys; sys.exit(3)"]) == 3
    assert launch([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]) == 128 + 9


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launcher_forwards_signals_to_the_child(tmp_path, sig):
    """SIGTERM/SIGINT to the launcher reach the child (in its own session); the launcher exits with its status."""
    marker = tmp_path / "got"
    child = textwrap.dedent(f"""
        import os, signal, sys, time
        def on(signum, _):
            open({str(marker)!r}, "w").write(str(signum))
            os._exit(7)
        signal.signal(signal.SIGTERM, on)
        signal.signal(signal.SIGINT, on)
        print("ready", os.getsid(0), flush=True)
        time.sleep(60)
    """)
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import sys; from sdforge.training.launch import launch; sys.exit(launch(sys.argv[1:]))"]
        + [sys.executable, "-c", child],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    ready = launcher.stdout.readline().split()
    assert ready[0] == "ready" and int(ready[1]) != os.getsid(launcher.pid)  # the child has its own session
    launcher.send_signal(sig)
    assert launcher.wait(timeout=30) == 7
    assert marker.read_text() == str(int(sig))


def _params_with(tmp_path: Path, **train) -> Path:
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["train"].update(train)
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_stage_entry_relaunches_and_fails_with_the_status(tmp_path, monkeypatch, caplog):
    params = _params_with(tmp_path, nproc_per_node=2)
    phase = next(iter(yaml.safe_load(params.read_text())["phases"]))
    argv = ["--params", str(params), "--item", phase]
    seen = []
    monkeypatch.setattr(training_cli, "launch", lambda cmd: seen.append(cmd) or 3)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exc:
        train_stage.main(argv)
    assert exc.value.code == 3
    assert seen == [torchrun_command(Train(nproc_per_node=2), argv)]
    assert f"train@{phase}: torchrun (1 node(s) x 2 process(es)) exited with status 3" in caplog.text


def test_a_torchrun_rank_trains_instead_of_relaunching(tmp_path, monkeypatch):
    params = _params_with(tmp_path, nproc_per_node=2)
    argv = ["--params", str(params), "--item", "phase1"]
    calls = []
    monkeypatch.setattr(training_cli, "launch", lambda cmd: pytest.fail("a rank must not relaunch"))
    monkeypatch.setattr(training_cli, "run_stage_command", lambda *a, **k: calls.append("rank0: run_stage_command"))
    monkeypatch.setattr(train_stage, "run", lambda params, item: calls.append(f"rank1: run {item}"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    train_stage.main(argv)
    monkeypatch.setenv("RANK", "1")
    train_stage.main(argv)
    # only rank 0 goes through the stage command (metrics JSON, MLflow)
    assert calls == ["rank0: run_stage_command", "rank1: run phase1"]


TWO_NODE_WORKER = textwrap.dedent("""
    import hashlib, json, os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1 + rank)  # each rank sees different data
    for _ in range(5):
        x = torch.randn(8, 4, generator=gen)
        loss = ((ddp(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients
        opt.step()
    ranks = torch.tensor([float(rank)])
    dist.all_reduce(ranks)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    out = {"rank": rank, "world": world, "rank_sum": ranks.item(), "weights": digest,
           "node_rank_arg": os.environ.get("GROUP_RANK")}
    open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w").write(json.dumps(out))
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_two_nodes_on_loopback_rendezvous_and_agree(tmp_path):
    """Two "nodes" (separate torchrun process groups, 1 process each) meet at a c10d rendezvous on
    127.0.0.1 with the command :func:`torchrun_command` builds, train with gloo DDP and end identical."""
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "two_node_worker.py").write_text(TWO_NODE_WORKER)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    nodes = []
    for node_rank in (0, 1):
        cfg = Train(nproc_per_node=1, nnodes=2, node_rank=node_rank, rdzv_endpoint=f"127.0.0.1:{port}")
        cmd = torchrun_command(cfg, [str(tmp_path)], module="two_node_worker")
        assert cmd[cmd.index("--rdzv_endpoint") + 1] == f"127.0.0.1:{port}" and "--standalone" not in cmd
        nodes.append((cmd, env))
    ended = run_node_agents(nodes, tmp_path, timeout=240)
    assert [rc for rc, _ in ended] == [0, 0], "\n".join(out[-3000:] for _, out in ended)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2] and [r["rank_sum"] for r in ranks] == [1.0, 1.0]
    assert {r["node_rank_arg"] for r in ranks} == {"0", "1"}  # one process per node
    assert ranks[0]["weights"] == ranks[1]["weights"]
