"""The multi-node training job as Kubernetes objects, and the volumes and environment every sdforge pod shares.

Why an **Indexed Job with a headless Service** (and not a Kubeflow ``PyTorchJob`` or a ``JobSet``): it is core
Kubernetes (``batch/v1``, GA since 1.24), so a cluster needs no operator or CRD installed, the manifests validate
against the core OpenAPI schemas, and it gives what ``torchrun`` needs: ``nnodes`` pods started together, each
knowing its index (the ``batch.kubernetes.io/job-completion-index`` annotation → ``SDFORGE_NODE_RANK`` → torchrun's
``--node_rank``), and a stable DNS name for pod 0 (``<job>-0.<service>``: an Indexed Job's pod is named
``<job>-<index>`` and ``subdomain`` puts it under the headless Service) where every pod meets for the c10d
rendezvous. ``backoffLimit: 0`` and ``restartPolicy: Never``: a failed pod fails the job at once, and the retry is
Prefect's (the train task reruns the stage, which resumes from the newest checkpoint on S3).

Every pod runs the train stage's own entry, ``python -m stages.train --params <the job's params> --item <phase>``:
with ``SDFORGE_NODE_RANK`` set the stage starts torchrun as node ``SDFORGE_NODE_RANK`` of ``train.nnodes``
(:mod:`sdforge.training.launch`) instead of submitting a job. The params travel in a ``ConfigMap`` (the exact file
the submitting stage read, with ``train.rdzv_endpoint`` set to pod 0), the code in the image.
"""

from __future__ import annotations

import copy
import hashlib
import math
import re
import secrets
from pathlib import PurePosixPath

import yaml

from sdforge.cluster.checks import gpus_per_pod
from sdforge.config import Params, parse_params
from sdforge.training.launch import NODE_RANK_ENV, SHUTDOWN_MARGIN_S, TRAIN_JOB_ENV

PARAMS_DIR = "/etc/sdforge"
"""Where a training pod mounts its ConfigMap; the params file is ``params.yaml`` in it."""
HF_HOME = "/cache/huggingface"
"""The model cache (the image's ``HF_HOME`` volume)."""
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
JOB_LABEL = "sdforge.io/train-job"
GRACE_MARGIN_S = 5
"""Pod grace beyond torchrun's shutdown timeout (``train.preempt_grace_s`` + its margin): the launcher exits last."""


def job_name(phase: str, params_text: str, attempt: str | None = None) -> str:
    """``sdforge-<phase>-<6 hex of the params>-<attempt>``: a DNS label short enough for ``<name>-<index>`` pod
    names. ``attempt`` (default: 4 random hex) keeps a retry's job apart from the failed one, which stays for
    ``cluster.job_ttl_s`` with its pods' logs."""
    digest = hashlib.sha256(params_text.encode()).hexdigest()[:6]
    slug = re.sub(r"[^a-z0-9-]+", "-", phase.lower()).strip("-")[:30] or "phase"
    return f"sdforge-{slug}-{digest}-{attempt or secrets.token_hex(2)}"


def work_mounts(params: Params) -> list[tuple[str, str]]:
    """``(mount path, sub path in the work claim)`` for every top folder of ``paths.*`` (relative ones under
    ``cluster.repo_dir``) and DVC's cache: one claim, mounted where the params and DVC look."""
    tops = {".dvc/cache"}
    for value in params.paths.model_dump().values():
        path = PurePosixPath(value)
        tops.add(str(path) if path.is_absolute() else path.parts[0])
    mounts = []
    for top in sorted(tops):
        path = PurePosixPath(top)
        mount = path if path.is_absolute() else PurePosixPath(params.cluster.repo_dir) / path
        mounts.append((str(mount), str(path).strip("/")))
    return mounts


def pod_volumes(params: Params) -> tuple[list[dict], list[dict]]:
    """``(volumes, volumeMounts)`` every sdforge pod has: memory-backed ``/dev/shm``, the work claim (else an
    ``emptyDir``), the model cache."""
    cluster = params.cluster
    work = {"persistentVolumeClaim": {"claimName": cluster.work_pvc}} if cluster.work_pvc else {"emptyDir": {}}
    cache = {"persistentVolumeClaim": {"claimName": cluster.cache_pvc}} if cluster.cache_pvc else {"emptyDir": {}}
    volumes = [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cluster.shm_size}},
        {"name": "work", **work},
        {"name": "cache", **cache},
    ]
    mounts = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": str(PurePosixPath(HF_HOME).parent)},
    ]
    mounts += [{"name": "work", "mountPath": path, "subPath": sub} for path, sub in work_mounts(params)]
    return volumes, mounts


def pod_env(params: Params) -> dict[str, str]:
    """Environment every sdforge pod gets: no credentials (S3 comes from the service account)."""
    env = {"HF_HOME": HF_HOME, "SDFORGE_PROGRESS": "0", "PYTHONUNBUFFERED": "1"}
    if params.cluster.mlflow_tracking_uri:
        env["MLFLOW_TRACKING_URI"] = params.cluster.mlflow_tracking_uri
    if params.storage.endpoint_url:
        env["AWS_ENDPOINT_URL"] = params.storage.endpoint_url
    return env


def rendezvous_host(job: str, namespace: str) -> str:
    """Pod 0's stable DNS name: ``<job>-0.<service>.<namespace>.svc`` (the Service is named like the job)."""
    return f"{job}-0.{job}.{namespace}.svc"


def job_params(data: dict, job: str) -> dict:
    """The params the training pods read: ``data`` with ``train.rdzv_endpoint`` at pod 0 and ``node_rank`` 0
    (each pod's own rank comes from ``SDFORGE_NODE_RANK``)."""
    params = parse_params(data)
    out = copy.deepcopy(data)
    host = rendezvous_host(job, params.cluster.namespace)
    out.setdefault("train", {}).update(rdzv_endpoint=f"{host}:{params.cluster.rdzv_port}", node_rank=0)
    return out


def _labels(job: str, phase: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "sdforge",
        "app.kubernetes.io/component": "train",
        JOB_LABEL: job,
        "sdforge.io/phase": re.sub(r"[^A-Za-z0-9_.-]", "-", phase)[:63],
    }


def _container(params: Params, job: str, phase: str) -> dict:
    cluster = params.cluster
    _, mounts = pod_volumes(params)
    env = [{"name": k, "value": v} for k, v in {**pod_env(params), TRAIN_JOB_ENV: job}.items()]
    env.append({"name": NODE_RANK_ENV, "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}})
    gpus = str(gpus_per_pod(params))
    return {
        "name": "train",
        "image": cluster.image,
        "workingDir": cluster.repo_dir,
        "command": ["python", "-m", "stages.train", "--params", f"{PARAMS_DIR}/params.yaml", "--item", phase],
        "env": env,
        "ports": [{"name": "rdzv", "containerPort": cluster.rdzv_port}],
        "resources": {
            "requests": {"cpu": cluster.cpu, "memory": cluster.memory, cluster.gpu_resource: gpus},
            "limits": {"memory": cluster.memory, cluster.gpu_resource: gpus},
        },
        "volumeMounts": [*mounts, {"name": "params", "mountPath": PARAMS_DIR, "readOnly": True}],
        "securityContext": {"allowPrivilegeEscalation": False},
    }


def training_job(data: dict, phase: str, attempt: str | None = None) -> list[dict]:
    """The objects of ``phase``'s training job, in creation order: ConfigMap (params), headless Service, Job
    (``attempt``: the job name's last part, :func:`job_name`)."""
    params = parse_params(data)
    text = yaml.safe_dump(data, sort_keys=True)
    job = job_name(phase, text, attempt)
    cluster, nnodes = params.cluster, params.train.nnodes
    meta = {"name": job, "namespace": cluster.namespace, "labels": _labels(job, phase)}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {**meta, "name": f"{job}-params"},
        "data": {"params.yaml": yaml.safe_dump(job_params(data, job), sort_keys=False)},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta,
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # pods resolve before any readiness: the rendezvous comes first
            "selector": {JOB_LABEL: job},
            "ports": [{"name": "rdzv", "port": cluster.rdzv_port, "targetPort": cluster.rdzv_port}],
        },
    }
    volumes, _ = pod_volumes(params)
    grace = math.ceil(params.train.preempt_grace_s) + SHUTDOWN_MARGIN_S + GRACE_MARGIN_S
    pod_spec = {
        "subdomain": job,
        "restartPolicy": "Never",
        "serviceAccountName": cluster.service_account,
        "terminationGracePeriodSeconds": grace,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000},
        "containers": [_container(params, job, phase)],
        "volumes": [*volumes, {"name": "params", "configMap": {"name": f"{job}-params"}}],
    }
    if cluster.node_selector:
        pod_spec["nodeSelector"] = dict(cluster.node_selector)
    if cluster.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in cluster.tolerations]
    job_obj = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": meta,
        "spec": {
            "completionMode": "Indexed",
            "completions": nnodes,
            "parallelism": nnodes,
            "backoffLimit": 0,
            "ttlSecondsAfterFinished": cluster.job_ttl_s,
            "template": {"metadata": {"labels": _labels(job, phase)}, "spec": pod_spec},
        },
    }
    return [config_map, service, job_obj]
