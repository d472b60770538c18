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
import socket
import sys

import yaml

from sdforge.cluster.manifests import HF_HOME, PARAMS_DIR, training_job
from sdforge.training.launch import NODE_RANK_ENV
from tests.fixtures.training import DDP_MAX_ABS_DIFF, REPO, build_workspace, run_node_agents, train, weights


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job_pods(root, params_file):
    """The rendered job's container and its params, with the stand-ins above; (command, env) per pod."""
    data = yaml.safe_load(params_file.read_text())
    data["train"].update(nnodes=2, nproc_per_node=1)
    data["phases"]["phase1"]["batch_size"] = 4  # 2 nodes x 1 x 4 x accumulation 2 = the 1-process run's 16
    data["cluster"] = {"enabled": True, "image": "registry.example.com/sdforge:test", "work_pvc": "sdforge-work"}
    config_map, _service, job = training_job(data, "phase1")
    job_params = yaml.safe_load(config_map["data"]["params.yaml"])
    assert job_params["train"]["rdzv_endpoint"].startswith(f"{job['metadata']['name']}-0.")
    job_params["train"]["rdzv_endpoint"] = f"127.0.0.1:{_free_port()}"
    params_dir = root / "configmap"
    params_dir.mkdir()
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


def test_two_pods_of_the_job_train_like_one_process_with_the_same_global_batch(tmp_path_factory):
    root = tmp_path_factory.mktemp("two-pods")
    pods = _job_pods(root, build_workspace(root))
    ended = run_node_agents(pods, root)
    outputs = [out for _, out in ended]
    assert [rc for rc, _ in ended] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert "--nnodes 2 --node_rank 0" in outputs[0] and "--nnodes 2 --node_rank 1" in outputs[1]
    one_root = tmp_path_factory.mktemp("one-process")
    done = train(build_workspace(one_root), "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    two_metrics = json.loads((root / "metrics/train/phase1.json").read_text())
    one_metrics = json.loads((one_root / "metrics/train/phase1.json").read_text())
    assert two_metrics["world_size"] == 2 and one_metrics["world_size"] == 1
    assert two_metrics["global_batch"] == one_metrics["global_batch"] == 16
    assert two_metrics["steps"] == one_metrics["steps"] == 6
    for sub in ("unet", "unet_ema"):
        a, b = weights(root, "phase1", sub), weights(one_root, "phase1", sub)
        diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
        print(f"{sub}: max |2 pods - 1 process| = {diff:.3g}")
        assert diff <= DDP_MAX_ABS_DIFF, f"{sub}: two pods differ from one process by {diff:.3g} > {DDP_MAX_ABS_DIFF}"
