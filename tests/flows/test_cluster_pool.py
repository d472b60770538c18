"""The cluster's work pool and deployments against a real Prefect server on loopback.

``tools.cluster work-pool`` creates the Kubernetes work pool from ``deploy/kubernetes/work-pool.json`` with its
defaults from params (the server validates the template for the ``kubernetes`` worker type), and ``tools.cluster
deploy`` deploys ``deploy/kubernetes/prefect.yaml``: every deployment lands on that pool, with its job variables.
Nothing runs in a cluster here (no Kubernetes API): the worker is not started.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml
from prefect.client.orchestration import get_client

from sdforge.cluster.work_pool import pool_defaults
from sdforge.config import parse_params
from tests.fixtures.cluster import cluster_data
from tools.cluster import deployments
from tools.cluster import main as cluster_cli


def test_the_work_pool_and_the_cluster_deployments_on_a_prefect_server(prefect_stack, prefect_api, tmp_path,
                                                                     monkeypatch):
    """The server's records are read with Prefect's client (one process), not one ``prefect … inspect`` CLI
    process per record (~3 s each)."""
    data = cluster_data(2)
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(data))
    env = {**prefect_stack.env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for key in ("PREFECT_API_URL", "PREFECT_HOME", "PATH"):
        monkeypatch.setenv(key, env[key])
    assert cluster_cli(["work-pool", "--params", str(params_file), "--pool", "gpu-pods"]) == 0
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("gpu-pods")
        assert pool.type == "kubernetes"
        props = pool.base_job_template["variables"]["properties"]
        for key, value in pool_defaults(parse_params(data)).items():
            assert props[key]["default"] == value, key
        assert props["gpus"]["default"] == 2 and props["image"]["default"] == data["cluster"]["image"]
        # the deployments of deploy/kubernetes/prefect.yaml, on that pool, with their job variables. They share
        # their names with the local ones (train-phase/phase1 …): the stack's own deployments are put back
        # afterwards, or later tests' runs would wait for a Kubernetes worker
        try:
            assert cluster_cli(["deploy", "--params", str(params_file)]) == 0
            _check_deployments(client, data)
        finally:
            prefect_stack.deploy()
        assert client.read_deployment_by_name("train-phase/phase1").work_pool_name == prefect_stack.pool


def _check_deployments(client, data: dict) -> None:
    for name, variables in deployments().items():
        flow = name if name in ("data-prep", "eval") else "train-phase"
        deployment = client.read_deployment_by_name(f"{flow}/{name}")
        assert deployment.work_pool_name == "gpu-pods"
        assert deployment.job_variables == variables
        step = deployment.pull_steps[0]["prefect.deployments.steps.set_working_directory"]
        assert step["directory"] == parse_params(data).cluster.repo_dir  # the image's repo, from params
