"""Submit a training job, stream its pods' logs into the stage's log, wait, and fail with the job's reason.

The Kubernetes calls go through :class:`KubernetesApi` (the ``kubernetes`` client, in-cluster credentials: the
flow pod's service account may create Jobs, Services and ConfigMaps in its namespace, docs/CLUSTER.md); the logic
in :func:`run_training_job` sees only the small :class:`ClusterApi` protocol, which the tests fake.

Exit statuses: a pod that ended with the train stage's own statuses (75 preempted, 76 hung) gives that status; a
pod killed by a signal or evicted (its node drained, a spot node reclaimed) gives 75 too — the stage was cut off,
and rerunning resumes from the newest checkpoint on S3 — so that Prefect's retry of the train task
(``flows/tasks.py``, only on 75/76) takes it. Anything else fails the stage with the pod's code and reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from sdforge.training.exits import HUNG, PREEMPTED

log = logging.getLogger(__name__)

RESUMABLE = (PREEMPTED, HUNG)
SIGNALLED = range(129, 160)
"""Container exit codes 128 + N: killed by signal N (SIGTERM 143, SIGKILL 137)."""
EVICTED_REASONS = {"Evicted", "Preempting", "DeletionByTaintManager", "Shutdown", "NodeShutdown", "Terminated"}


@dataclass(frozen=True)
class PodState:
    """One pod of the job: its completion index, phase and, once ended, exit code and reason."""

    name: str
    index: int
    phase: str
    exit_code: int | None = None
    reason: str | None = None


class ClusterApi(Protocol):
    """The calls :func:`run_training_job` makes."""

    def create(self, obj: dict) -> None: ...
    def delete(self, obj: dict) -> None: ...
    def job_conditions(self, namespace: str, name: str) -> list[dict]: ...
    def pods(self, namespace: str, job: str) -> list[PodState]: ...
    def logs(self, namespace: str, pod: str) -> Iterator[str]: ...


class JobFailed(RuntimeError):
    """The training job failed; ``status`` is the exit status the stage should end with."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def failure_status(pods: list[PodState]) -> tuple[int, str]:
    """The stage's exit status for a failed job, and why, in words (the first failed pod by index decides)."""
    failed = sorted((p for p in pods if p.phase == "Failed"), key=lambda p: p.index)
    if not failed:
        return 1, "no pod reported a failure"
    pod = failed[0]
    why = f"pod {pod.name} (node rank {pod.index}) exited with {pod.exit_code} ({pod.reason or 'no reason given'})"
    if pod.exit_code in RESUMABLE:
        return pod.exit_code, why
    if pod.exit_code in SIGNALLED or pod.reason in EVICTED_REASONS:
        return PREEMPTED, why + "; treated as preempted: rerunning resumes from the newest checkpoint"
    return pod.exit_code or 1, why


def _follow(api: ClusterApi, namespace: str, pod: PodState, sink: Callable[[str], None]) -> None:
    try:
        for line in api.logs(namespace, pod.name):
            sink(f"[node {pod.index}] {line.rstrip()}")
    except Exception as err:  # noqa: BLE001 - a broken log stream must not fail the job
        sink(f"[node {pod.index}] (log stream ended: {err})")


def _ended(conditions: list[dict]) -> str | None:
    for cond in conditions:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return cond["type"] if cond["type"] == "Complete" else f"Failed: {cond.get('reason') or 'no reason'}"
    return None


def run_training_job(
    objects: list[dict],
    api: ClusterApi,
    sink: Callable[[str], None] = log.info,
    poll_s: float = 5.0,
    timeout_s: float | None = None,
) -> None:
    """Create ``objects`` (ConfigMap, Service, Job), stream each pod's log through ``sink`` as it starts, wait for
    the Job to end; raise :class:`JobFailed` with the status and reason if it failed. The ConfigMap and Service
    are deleted at the end; the Job stays for ``cluster.job_ttl_s`` (its pods' logs with it)."""
    job = next(o for o in objects if o["kind"] == "Job")
    namespace, name = job["metadata"]["namespace"], job["metadata"]["name"]
    for obj in objects:
        api.create(obj)
    sink(f"submitted job {namespace}/{name}: {job['spec']['completions']} pod(s)")
    followed: dict[str, threading.Thread] = {}
    started = time.monotonic()
    try:
        while True:
            pods = api.pods(namespace, name)
            for pod in pods:
                if pod.name not in followed and pod.phase != "Pending":
                    thread = threading.Thread(target=_follow, args=(api, namespace, pod, sink), daemon=True)
                    followed[pod.name] = thread
                    thread.start()
            ended = _ended(api.job_conditions(namespace, name))
            if ended:
                break
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise JobFailed(f"job {name} still running after {timeout_s:.0f} s", 1)
            time.sleep(poll_s)
        for thread in followed.values():
            thread.join(timeout=30)
        if ended != "Complete":
            status, why = failure_status(api.pods(namespace, name))
            raise JobFailed(f"job {namespace}/{name} {ended}; {why}", status)
        sink(f"job {namespace}/{name} complete")
    finally:
        for obj in objects:
            if obj["kind"] != "Job":
                api.delete(obj)


class KubernetesApi:
    """:class:`ClusterApi` on the ``kubernetes`` client: the pod's in-cluster credentials (else the kubeconfig), or
    ``host`` (an API server URL; the tests' loopback stand-in)."""

    def __init__(self, host: str | None = None):
        from kubernetes import client, config  # only where a cluster is used: the tests fake this class

        if host:
            api = client.ApiClient(client.Configuration(host=host))
        else:  # pragma: no cover - needs a cluster
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = client.ApiClient()
        self.core, self.batch = client.CoreV1Api(api), client.BatchV1Api(api)

    def create(self, obj: dict) -> None:
        ns = obj["metadata"]["namespace"]
        create = {
            "ConfigMap": self.core.create_namespaced_config_map,
            "Service": self.core.create_namespaced_service,
            "Job": self.batch.create_namespaced_job,
        }[obj["kind"]]
        create(ns, obj)

    def delete(self, obj: dict) -> None:
        ns, name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        delete = {"ConfigMap": self.core.delete_namespaced_config_map, "Service": self.core.delete_namespaced_service}
        delete[obj["kind"]](name, ns)

    def job_conditions(self, namespace: str, name: str) -> list[dict]:
        status = self.batch.read_namespaced_job_status(name, namespace).status
        return [{"type": c.type, "status": c.status, "reason": c.reason} for c in status.conditions or []]

    def pods(self, namespace: str, job: str) -> list[PodState]:
        items = self.core.list_namespaced_pod(namespace, label_selector=f"job-name={job}").items
        return [_pod_state(p) for p in items]

    def logs(self, namespace: str, pod: str) -> Iterator[str]:
        stream = self.core.read_namespaced_pod_log(pod, namespace, follow=True, _preload_content=False)
        for raw in stream.stream():
            yield from raw.decode(errors="replace").splitlines()


def _pod_state(pod) -> PodState:
    annotations = pod.metadata.annotations or {}
    index = int(annotations.get("batch.kubernetes.io/job-completion-index", "0"))
    code = reason = None
    for status in pod.status.container_statuses or []:
        if status.state and status.state.terminated:
            code, reason = status.state.terminated.exit_code, status.state.terminated.reason
    return PodState(pod.metadata.name, index, pod.status.phase, code, reason or pod.status.reason)
