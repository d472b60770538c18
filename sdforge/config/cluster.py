"""``cluster``: Kubernetes, for the flows' pods and multi-node training jobs (docs/CLUSTER.md)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field

from sdforge.config.base import Section, Url

_DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")


def check_dns_label(name: str) -> str:
    """Return ``name`` if Kubernetes accepts it as a namespace, service account or claim name (RFC 1123 label)."""
    if not _DNS_LABEL.fullmatch(name):
        raise ValueError(f"not a Kubernetes name: lower-case letters, digits and '-', at most 63; got {name!r}")
    return name


DnsLabel = Annotated[str, AfterValidator(check_dns_label)]


class Cluster(Section):
    """Kubernetes: the flows' pods (a Prefect Kubernetes work pool) and multi-node training jobs (docs/CLUSTER.md).

    Nothing here is a credential: S3 access comes from ``service_account`` (IRSA / workload identity), MLflow's
    address is a URL without a password. Off (``enabled: false``): every stage runs where the flow runs."""

    enabled: bool = False
    """On: with ``train.nnodes > 1`` the train stage submits an Indexed Job of ``nnodes`` pods (sdforge/cluster)."""
    image: str | None = None
    """The image built by ``make image`` (``registry/sdforge:<git sha>``); the flows' pods and the training pods."""
    namespace: DnsLabel = "sdforge"
    service_account: DnsLabel = "sdforge"
    """The pods' service account: the one that grants the S3 bucket (no keys in any manifest or the image)."""
    gpu_resource: str = "nvidia.com/gpu"
    gpus_per_pod: int | None = Field(None, ge=0)
    """GPUs requested per training pod; null: ``train.nproc_per_node`` (any other value is an error)."""
    cpu: str = "16"
    memory: str = "200Gi"
    shm_size: str = "64Gi"
    """Size of the memory-backed ``/dev/shm`` (an ``emptyDir`` with ``medium: Memory``): NCCL and data loaders."""
    node_selector: dict[str, str] = {}
    tolerations: list[dict[str, str]] = []
    work_pvc: DnsLabel | None = None
    """A ReadWriteMany claim holding the work dir (``paths.*``, DVC cache): required with ``train.nnodes > 1``, so
    that every training pod reads the phase's inputs and rank 0's outputs land where the flow's pod hashes them."""
    cache_pvc: DnsLabel | None = None
    """A claim for ``HF_HOME`` (model downloads); null: an ``emptyDir`` per pod."""
    repo_dir: str = "/opt/sdforge"
    """Where the image holds the repo (the pods' working directory; relative ``paths.*`` resolve under it)."""
    mlflow_tracking_uri: Url | None = None
    """``MLFLOW_TRACKING_URI`` of the pods (an in-cluster MLflow server)."""
    rdzv_port: int | None = Field(29400, ge=1, le=65535)
    """torchrun's c10d rendezvous port on pod 0 of a training job (its host is pod 0's stable DNS name; the job
    sets ``train.rdzv_endpoint`` from it). Required with ``train.nnodes > 1``."""
    job_ttl_s: int = Field(86400, ge=0)
    """Seconds a finished training job (and its pods' logs) stays before Kubernetes deletes it."""
