"""The Prefect Kubernetes work pool: its base job template (a file in the repo) with defaults from params, and
the Job it gives a flow run, rendered by ``prefect-kubernetes``' own job configuration code.

``deploy/kubernetes/work-pool.json`` is the template: GPUs, node selector and tolerations, a memory-backed
``/dev/shm``, the work claim, the S3 service account and MLflow's address are job variables. :func:`pool_template`
fills their defaults from params (``cluster.*``, ``train.nproc_per_node``, the mounts of ``paths.*``), so the
values live in one place; ``make work-pool`` creates the pool from it. A deployment's ``job_variables``
(``deploy/kubernetes/prefect.yaml``) override them per deployment (``gpus: 0`` for data-prep and eval).

prefect-kubernetes (0.8) insists on ``completions: 1`` and ``parallelism: 1`` inside the *pod* spec of every base
job template (its own default template has them there); the API server ignores them. They are kept, and the tests
validate every other field strictly.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import types
import uuid
from pathlib import Path

from sdforge.cluster.checks import gpus_per_pod
from sdforge.cluster.manifests import GRACE_MARGIN_S, pod_env, pod_volumes
from sdforge.config import Params
from sdforge.training.launch import SHUTDOWN_MARGIN_S

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "work-pool.json"
PREFECT_QUIRK_KEYS = ("completions", "parallelism")
"""Keys prefect-kubernetes requires in the pod spec of a base job template (see the module docstring)."""


def pool_defaults(params: Params) -> dict:
    """The work pool's variable defaults, from params."""
    cluster = params.cluster
    volumes, mounts = pod_volumes(params)
    defaults = {
        "namespace": cluster.namespace,
        "service_account_name": cluster.service_account,
        "repo_dir": cluster.repo_dir,
        "gpus": gpus_per_pod(params),
        "cpu": cluster.cpu,
        "memory": cluster.memory,
        "node_selector": dict(cluster.node_selector),
        "tolerations": [dict(t) for t in cluster.tolerations],
        "volumes": volumes,
        "volume_mounts": mounts,
        "env": pod_env(params),
        "termination_grace_s": math.ceil(params.train.preempt_grace_s) + SHUTDOWN_MARGIN_S + GRACE_MARGIN_S,
        "finished_job_ttl": cluster.job_ttl_s,
    }
    if cluster.image:
        defaults["image"] = cluster.image
    return defaults


def pool_template(params: Params, template: Path = TEMPLATE) -> dict:
    """The base job template with its variables' defaults taken from ``params``."""
    data = json.loads(template.read_text())
    props = data["variables"]["properties"]
    for key, value in pool_defaults(params).items():
        props[key]["default"] = value
    return data


def render_flow_job(template: dict, job_variables: dict, flow_run_name: str = "sdforge-run") -> dict:
    """The Job manifest a Kubernetes worker would create for a run of a deployment with ``job_variables``: the
    template's variables through ``KubernetesWorkerJobConfiguration.from_template_and_values`` and
    ``prepare_for_flow_run`` (prefect-kubernetes' own code). Offline: the template holds no block or variable
    references, so no Prefect API is asked."""
    # Prefect's worker code: loaded only to render (seconds of imports the train stage's submit never needs)
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    async def build():
        return await KubernetesWorkerJobConfiguration.from_template_and_values(
            copy.deepcopy(template), dict(job_variables), client=types.SimpleNamespace()
        )

    config = asyncio.run(build())
    run = FlowRun(flow_id=uuid.uuid4(), name=flow_run_name, deployment_id=uuid.uuid4())
    config.prepare_for_flow_run(run)
    return config.job_manifest
