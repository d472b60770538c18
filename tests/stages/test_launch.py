"""stages.launch: the torchrun command line, "already a rank?" detection, exit status and signal forwarding.

The real 2-process run through the stage CLI is in ``tests/stages/test_ddp.py``
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

from stages import train as train_stage
from stages.config import Train
from stages.launch import launch, needs_launch, torchrun_command

REPO = Path(__file__).resolve().parents[2]
ARGV = ["--params", "params.yaml", "--item", "phase1"]


def test_one_node_two_processes_is_standalone():
    cmd = torchrun_command(Train(nproc_per_node=2), ARGV)
    assert cmd == [
        sys.executable,
        *("-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1", "--node_rank", "0"),
        "--standalone",
        *("-m", "stages.train", *ARGV),
    ]


def test_two_nodes_rendezvous_at_the_endpoint():
    cfg = Train(nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="node0.cluster:29400")
    cmd = torchrun_command(cfg, ARGV)
    assert cmd[1:] == [
        *("-m", "torch.distributed.run", "--nproc_per_node", "8", "--nnodes", "2", "--node_rank", "1"),
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
        [sys.executable, "-c", "import sys; from stages.launch import launch; sys.exit(launch(sys.argv[1:]))"]
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
    monkeypatch.setattr(train_stage, "launch", lambda cmd: seen.append(cmd) or 3)
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
    monkeypatch.setattr(train_stage, "launch", lambda cmd: pytest.fail("a rank must not relaunch"))
    monkeypatch.setattr(train_stage, "stage_cli", lambda *a, **k: calls.append("rank0: stage_cli"))
    monkeypatch.setattr(train_stage, "run", lambda params, item: calls.append(f"rank1: run {item}"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    train_stage.main(argv)
    monkeypatch.setenv("RANK", "1")
    train_stage.main(argv)
    assert calls == ["rank0: stage_cli", "rank1: run phase1"]  # only rank 0 goes through stage_cli (metrics JSON)
