"""The job runner's logic against a fake Kubernetes API (no cluster here): objects created in order, every pod's
log streamed into the stage's log, the job's end awaited, its reason and the stage's exit status on failure."""

from __future__ import annotations

from sdforge.cluster.job_runner import JobFailed, KubernetesApi, PodState, failure_status, run_training_job
from sdforge.cluster.manifests import training_job
from sdforge.training.exits import HUNG, PREEMPTED
from tests.fixtures.cluster import FakeApi, cluster_data
from tests.fixtures.kube_api import KubeApiServer


def pods(*ends: tuple[str, int | None, str | None]) -> list[PodState]:
    return [PodState(f"job-{i}", i, phase, code, reason) for i, (phase, code, reason) in enumerate(ends)]


def run(api: FakeApi) -> list[str]:
    lines: list[str] = []
    run_training_job(training_job(cluster_data(2), "phase1"), api, sink=lines.append, poll_s=0)
    return lines


def test_a_complete_job_streams_every_pods_log_and_cleans_up():
    api = FakeApi(pods(("Succeeded", 0, "Completed"), ("Succeeded", 0, "Completed")), "Complete")
    lines = run(api)
    assert [kind for kind, _ in api.created] == ["ConfigMap", "Service", "Job"]
    assert sorted(kind for kind, _ in api.deleted) == ["ConfigMap", "Service"]  # the Job keeps the pods' logs
    assert "[node 0] job-0: step 2 loss 0.4" in lines and "[node 1] job-1: step 1 loss 0.5" in lines
    assert lines[0].startswith("submitted job sdforge/") and lines[-1].endswith("complete")


def test_a_failed_job_fails_with_the_pods_code_and_reason():
    api = FakeApi(pods(("Succeeded", 0, None), ("Failed", 1, "OOMKilled")), "Failed", "BackoffLimitExceeded")
    try:
        run(api)
    except JobFailed as err:
        assert err.status == 1
        assert "BackoffLimitExceeded" in str(err) and "node rank 1" in str(err) and "OOMKilled" in str(err)
    else:
        raise AssertionError("a failed job must raise")
    assert sorted(kind for kind, _ in api.deleted) == ["ConfigMap", "Service"]


def test_preempted_hung_signalled_and_evicted_pods_are_resumable():
    """75/76 from the stage itself, a kill by signal (143/137) or an eviction: the flow's retry resumes."""
    assert failure_status(pods(("Failed", PREEMPTED, "Error")))[0] == PREEMPTED
    assert failure_status(pods(("Running", None, None), ("Failed", HUNG, "Error")))[0] == HUNG
    assert failure_status(pods(("Failed", 137, "Error")))[0] == PREEMPTED
    assert failure_status(pods(("Failed", None, "Evicted")))[0] == PREEMPTED
    status, why = failure_status(pods(("Failed", 2, "Error")))
    assert status == 2 and "exited with 2" in why


def test_the_kubernetes_client_path_against_an_api_server_on_loopback():
    """The real ``kubernetes`` client (``KubernetesApi``) speaking HTTP to the stand-in API server: the objects are
    POSTed to the right collections, pods listed by the job's label, their logs followed, the ConfigMap and Service
    deleted at the end."""
    with KubeApiServer(exit_codes=[0, 0]) as server:
        lines: list[str] = []
        objects = training_job(cluster_data(2), "phase1")
        run_training_job(objects, KubernetesApi(host=server.url), sink=lines.append, poll_s=0.01)
    job = objects[2]["metadata"]["name"]
    assert server.created == [("ConfigMap", f"{job}-params"), ("Service", job), ("Job", job)]
    assert sorted(server.deleted) == [("configmaps", f"{job}-params"), ("services", job)]
    assert sorted(name for name, _ in server.log_reads) == [f"{job}-0-x", f"{job}-1-x"]
    assert all(query["follow"] == ["true"] for _, query in server.log_reads)
    assert f"[node 1] {job}-1-x: step 2 loss 0.4" in lines


def test_a_failed_pod_through_the_kubernetes_client_gives_its_status_and_reason():
    with KubeApiServer(exit_codes=[0, 137], reasons=["Completed", "OOMKilled"]) as server:
        try:
            run_training_job(training_job(cluster_data(2), "phase1"), KubernetesApi(host=server.url), poll_s=0.01)
        except JobFailed as err:
            assert err.status == PREEMPTED
            assert "BackoffLimitExceeded" in str(err) and "node rank 1" in str(err) and "OOMKilled" in str(err)
        else:
            raise AssertionError("a failed job must raise")
