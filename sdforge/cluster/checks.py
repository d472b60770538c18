"""Mistakes in params that would only show once pods run, caught before anything is submitted.

Each problem names the params key to change. :func:`check_cluster` raises :class:`ClusterConfigError` with all of
them; ``python -m tools.cluster check`` (``make cluster-check``), ``make work-pool`` and the train stage (before it
submits a job) call it. A rendezvous for ``train.nnodes > 1`` is checked when params load
(:class:`sdforge.config.Params`), so a params file without one never gets this far.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from sdforge.config import ConfigError, Params


class ClusterConfigError(ConfigError):
    """Params that cannot run on the cluster; the message lists every problem with its key."""


def gpus_per_pod(params: Params) -> int:
    """GPUs a training pod requests: ``cluster.gpus_per_pod``, else one per process (``train.nproc_per_node``)."""
    explicit = params.cluster.gpus_per_pod
    return params.train.nproc_per_node if explicit is None else explicit


def cluster_problems(params: Params) -> list[str]:
    """What in ``params`` keeps the flows or a training job from running on the cluster (empty: nothing)."""
    cluster, train, storage = params.cluster, params.train, params.storage
    problems = []
    if not cluster.enabled:
        return ["cluster.enabled: false — set it to true to run on Kubernetes (docs/CLUSTER.md)"]
    if not cluster.image:
        problems.append("cluster.image: not set — the image `make image` built and pushed (registry/sdforge:<sha>)")
    if gpus_per_pod(params) != train.nproc_per_node:
        problems.append(
            f"cluster.gpus_per_pod: {cluster.gpus_per_pod} GPUs requested per pod but train.nproc_per_node is "
            f"{train.nproc_per_node} processes per node — make them equal (or set cluster.gpus_per_pod: null)"
        )
    if not storage.dvc_remote:
        problems.append(
            "storage.dvc_remote: not set — a pod starts empty and restores finished stages from this S3 remote"
        )
    if not train.checkpoint_s3:
        problems.append("train.checkpoint_s3: not set — a replacement pod resumes training from this S3 prefix")
    if train.nnodes > 1 and not cluster.work_pvc:
        problems.append(
            f"cluster.work_pvc: not set but train.nnodes is {train.nnodes} — the training pods and the flow's pod "
            "need one ReadWriteMany claim for the work dir"
        )
    if len(PurePosixPath(params.paths.models).parts) < 2:
        problems.append(
            f"paths.models: {params.paths.models!r} would be a mount point of the work claim (each top folder of "
            "paths.* is one), and DVC deletes prepare_models' whole output before it reruns, which a mount point "
            "cannot be — put it one level down, e.g. 'models/sd'"
        )
    return problems


def check_cluster(params: Params) -> None:
    """Raise :class:`ClusterConfigError` naming every problem :func:`cluster_problems` finds."""
    problems = cluster_problems(params)
    if problems:
        raise ClusterConfigError("params cannot run on the cluster:\n  - " + "\n  - ".join(problems))
