"""The cluster's multi-node launch path, for real on this machine: two node agents run the training job's pods.

The Indexed Job for ``train.nnodes: 2`` is rendered (:func:`sdforge.cluster.manifests.training_job`), and each of
its two "pods" is a process started with the job container's own command (the train stage's entry) and its env,
``SDFORGE_NODE_RANK`` resolved as Kubernetes resolves its ``fieldRef`` (the pod's completion index), on the params
the job's ConfigMap holds. What stands in for the cluster, and nothing else: the ConfigMap's and the cache volume's
mount paths become temp folders, and the rendezvous endpoint — pod 0's DNS name on the cluster — becomes
127.0.0.1 on a free port. Each agent is then ``torchrun --nnodes 2 --node_rank <index>`` with c10d on loopback,
gloo, one rank each. The result must match one process with the same global batch within the DDP test's tolerance.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from sdforge.cluster.manifests import HF_HOME, PARAMS_DIR, training_job
from sdforge.training.exits import PREEMPTED
from sdforge.training.launch import NODE_RANK_ENV
from tests.fixtures.training import DDP_MAX_ABS_DIFF, REPO, run_node_agents, untrained_clone, weights

pytestmark = pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_pods(root, params_file, parallel: str = "ddp"):
    """The rendered job's container and its params (``train.parallel``: ``parallel``), with the stand-ins above;
    (command, env) per pod."""
    data = yaml.safe_load(params_file.read_text())
    data["train"].update(nnodes=2, nproc_per_node=1, parallel=parallel)
    data["phases"]["phase1"]["batch_size"] = 4  # 2 nodes x 1 x 4 x accumulation 2 = the 1-process run's 16
    data["cluster"] = {"enabled": True, "image": "registry.example.com/sdforge:test", "work_pvc": "sdforge-work"}
    config_map, _service, job = training_job(data, "phase1")
    job_params = yaml.safe_load(config_map["data"]["params.yaml"])
    assert job_params["train"]["rdzv_endpoint"].startswith(f"{job['metadata']['name']}-0.")
    job_params["train"]["rdzv_endpoint"] = f"127.0.0.1:{_free_port()}"
    params_dir = root / "configmap"
    params_dir.mkdir(exist_ok=True)
    (params_dir / "params.yaml").write_text(yaml.safe_dump(job_params))
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command = [sys.executable if a == "python" else a for a in container["command"]]
    command = [str(params_dir / "params.yaml") if a == f"{PARAMS_DIR}/params.yaml" else a for a in command]
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    env["HF_HOME"] = str(root / HF_HOME.strip("/"))
    fields = [e for e in container["env"] if "valueFrom" in e]
    assert [e["name"] for e in fields] == [NODE_RANK_ENV]
    base = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    return [(command, {**base, **env, NODE_RANK_ENV: str(index)}) for index in range(job["spec"]["completions"])]


def _train_on_two_pods(root: Path, straight_phase1: Path, parallel: str) -> Path:
    """phase1 trained, uninterrupted, by the job's two pods in ``root``; ``root``."""
    ended = run_node_agents(_job_pods(root, untrained_clone(straight_phase1, root), parallel), root)
    outputs = [out for _, out in ended]
    assert [rc for rc, _ in ended] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert "--nnodes 2 --node_rank 0" in outputs[0] and "--nnodes 2 --node_rank 1" in outputs[1]
    return root


@pytest.fixture(scope="module")
def two_pods(tmp_path_factory, straight_phase1):
    """phase1 trained, uninterrupted, by the job's two pods (DDP); the workspace root."""
    return _train_on_two_pods(tmp_path_factory.mktemp("two-pods"), straight_phase1, "ddp")


def test_two_pods_of_the_job_train_like_one_process_with_the_same_global_batch(two_pods, straight_phase1):
    diffs = _against_one_process(two_pods, straight_phase1, "ddp")
    assert max(diffs.values()) <= DDP_MAX_ABS_DIFF, f"two pods differ from one process: {diffs}"


def test_two_pods_shard_the_model_over_the_nodes_like_one_process(tmp_path, straight_phase1):
    """``train.parallel: fsdp`` across the two pods: each pod's rank writes its own shards into the shared work
    dir (the job's ReadWriteMany claim; here one folder), every checkpoint holds both, and the result matches one
    process."""
    root = _train_on_two_pods(tmp_path, straight_phase1, "fsdp")
    diffs = _against_one_process(root, straight_phase1, "fsdp")
    assert max(diffs.values()) <= DDP_MAX_ABS_DIFF, f"two sharded pods differ from one process: {diffs}"
    newest = sorted((root / "runs/phase1").glob("checkpoint-*"))[-1]
    files = json.loads((newest / "COMPLETE").read_text())["files"]
    assert sorted(f for f in files if f.startswith("sharded/")) == [
        "sharded/.metadata", "sharded/__0_0.distcp", "sharded/__1_0.distcp"]  # fmt: skip


def _against_one_process(root: Path, one_root: Path, parallel: str) -> dict[str, float]:
    """``root``'s phase1 (two pods) against the shared one-process run (batch 8 × accumulation 2 = 16): the run's
    shape checked, and the max weight difference of ``unet`` and ``unet_ema``."""
    two_metrics = json.loads((root / "metrics/train/phase1.json").read_text())
    one_metrics = json.loads((one_root / "metrics/train/phase1.json").read_text())
    assert (two_metrics["world_size"], two_metrics["parallel"], one_metrics["world_size"]) == (2, parallel, 1)
    assert two_metrics["global_batch"] == one_metrics["global_batch"] == 16
    assert two_metrics["steps"] == one_metrics["steps"] == 6
    diffs = {}
    for sub in ("unet", "unet_ema"):
        a, b = weights(root, "phase1", sub), weights(one_root, "phase1", sub)
        diffs[sub] = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        print(f"{sub}: max |2 pods - 1 process| = {diffs[sub]:.3g}")
    return diffs


def _terminate_pod_after_steps(agents: list[subprocess.Popen], steps_file: Path, steps: int, pod: int) -> None:
    """SIGTERM pod ``pod``'s entry process (what the kubelet signals) once rank 0 has logged ``steps`` steps."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and all(a.poll() is None for a in agents):
        if steps_file.exists() and len(steps_file.read_text().splitlines()) >= steps:
            os.kill(agents[pod].pid, signal.SIGTERM)
            return
        time.sleep(0.02)
    raise AssertionError(f"rank 0 never logged {steps} steps")


@pytest.mark.slow  # ~80 s (issue 40: the suite's time); the default run covers SIGTERM → checkpoint → bit-identical
# resume in tests/stages/test_resilience.py (one node, two ranks) and the two-pod launch in the test above
def test_sigterm_to_one_pod_checkpoints_every_pod_and_the_rerun_resumes_bit_identically(
    two_pods, fresh_workspace, tmp_path
):
    """A pod deleted (or a spot node reclaimed) gets SIGTERM: its launcher forwards it to torchrun, the ranks of
    both pods agree to stop at the next step boundary, write one checkpoint and exit 75 — the status the job
    runner hands to the flow's retry — and the rerun of both pods resumes and ends bit-identical."""
    workspace = fresh_workspace
    pods = _job_pods(tmp_path, workspace)
    agents = [
        subprocess.Popen(cmd, cwd=tmp_path, env=env, start_new_session=True, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for cmd, env in pods
    ]  # fmt: skip
    threading.Thread(
        target=_terminate_pod_after_steps, args=(agents, tmp_path / "runs/phase1/steps.jsonl", 2, 1), daemon=True
    ).start()
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [a.returncode for a in agents] == [PREEMPTED, PREEMPTED], "\n".join(o[-3000:] for o in outputs)
    stopped_at = json.loads((tmp_path / "runs/phase1/PREEMPTED.json").read_text())["step"]
    assert 2 < stopped_at < 6 and (tmp_path / f"runs/phase1/checkpoint-{stopped_at:08d}/COMPLETE").is_file()
    ended = run_node_agents(_job_pods(tmp_path, workspace), tmp_path)
    assert [rc for rc, _ in ended] == [0, 0], "\n".join(out[-3000:] for _, out in ended)
    assert f"at step {stopped_at} " in ended[0][1]
    for sub in ("unet", "unet_ema"):
        a, b = weights(two_pods, "phase1", sub), weights(tmp_path, "phase1", sub)
        assert all(torch.equal(a[k], b[k]) for k in a), f"{sub}: the resumed pods differ from the uninterrupted ones"
