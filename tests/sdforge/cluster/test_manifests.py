"""Every manifest the project can produce, rendered and validated against Kubernetes' OpenAPI schemas (offline).

The multi-node training job for ``train.nnodes`` 1, 2 and 4, and the Job the Prefect Kubernetes worker creates for
each deployment of ``deploy/kubernetes/prefect.yaml`` (rendered through prefect-kubernetes' own
``KubernetesWorkerJobConfiguration``). Validation: ``kubernetes-validate`` strict (unknown fields are errors) for
its newest Kubernetes release. Then what matters: GPUs requested = ``train.nproc_per_node``, ``/dev/shm``
memory-backed, no credential in any manifest, the rendezvous endpoint reachable by name from every pod, retries
left to Prefect.
"""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml

from sdforge.cluster.manifests import COMPLETION_INDEX, JOB_LABEL, PARAMS_DIR, training_job
from sdforge.cluster.work_pool import PREFECT_QUIRK_KEYS, pool_template, render_flow_job
from sdforge.config import parse_params
from tests.fixtures.cluster import IMAGE, REPO, cluster_data
from tools.cluster import deployments, render_all

K8S = kubernetes_validate.latest_version()


def validate(obj: dict) -> None:
    """Strict OpenAPI validation of one object as the API server would receive it (JSON round trip)."""
    kubernetes_validate.validate(json.loads(json.dumps(obj)), K8S, strict=True)


def by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


def container(job: dict) -> dict:
    (only,) = job["spec"]["template"]["spec"]["containers"]
    return only


def test_the_validator_rejects_a_wrong_field():
    """The schema check can fail: a misspelt field and a wrong type are both errors."""
    job = by_kind(training_job(cluster_data(2), "phase1"))["Job"]
    job["spec"]["template"]["spec"]["restartPolicyy"] = "Never"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(job)
    job = by_kind(training_job(cluster_data(2), "phase1"))["Job"]
    job["spec"]["completions"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(job)


@pytest.mark.parametrize("nnodes", [1, 2, 4])
def test_training_job_validates_and_holds_what_matters(nnodes):
    data = cluster_data(nnodes)
    params = parse_params(data)
    objects = training_job(data, "phase3")
    assert [o["kind"] for o in objects] == ["ConfigMap", "Service", "Job"]
    for obj in objects:
        validate(obj)
    kinds = by_kind(objects)
    job, service, config_map = kinds["Job"], kinds["Service"], kinds["ConfigMap"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    name = job["metadata"]["name"]
    # N pods, each knowing its index; one failure fails the job, Prefect retries
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == nnodes
    assert spec["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    # GPUs = processes per node (full config: 2), requested and limited
    gpus = str(params.train.nproc_per_node)
    assert container(job)["resources"]["limits"]["nvidia.com/gpu"] == gpus == "2"
    assert container(job)["resources"]["requests"]["nvidia.com/gpu"] == gpus
    # memory-backed /dev/shm
    shm = {v["name"]: v for v in pod["volumes"]}["dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(job)["volumeMounts"]
    # the rendezvous: pod 0's DNS name under a headless Service that selects every pod of the job
    job_params = yaml.safe_load(config_map["data"]["params.yaml"])
    host, port = job_params["train"]["rdzv_endpoint"].rsplit(":", 1)
    assert host == f"{name}-0.{service['metadata']['name']}.{params.cluster.namespace}.svc"
    assert pod["subdomain"] == service["metadata"]["name"] == name
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {JOB_LABEL: name}
    assert job["spec"]["template"]["metadata"]["labels"][JOB_LABEL] == name
    assert int(port) == service["spec"]["ports"][0]["port"] == container(job)["ports"][0]["containerPort"]
    assert job_params["train"]["nnodes"] == nnodes
    # every pod runs the train stage's own entry on the job's params, its node rank from its index
    assert container(job)["command"] == [
        "python", "-m", "stages.train", "--params", f"{PARAMS_DIR}/params.yaml", "--item", "phase3",
    ]  # fmt: skip
    env = {e["name"]: e for e in container(job)["env"]}
    assert env["SDFORGE_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == COMPLETION_INDEX
    assert env["SDFORGE_TRAIN_JOB"]["value"] == name
    assert container(job)["image"] == IMAGE
    # the pod's grace covers the preemption checkpoint (train.preempt_grace_s) and torchrun's shutdown
    assert pod["terminationGracePeriodSeconds"] > params.train.preempt_grace_s + 10


def test_each_submission_gets_its_own_job_name():
    """A retry must not collide with the failed job, which stays for cluster.job_ttl_s with its logs."""
    first, second = (by_kind(training_job(cluster_data(2), "phase_7"))["Job"]["metadata"]["name"] for _ in range(2))
    assert first != second and first.rsplit("-", 1)[0] == second.rsplit("-", 1)[0]
    assert first.startswith("sdforge-phase-7-") and len(f"{first}-3") <= 63
    named = by_kind(training_job(cluster_data(2), "phase7", attempt="a1b2"))["Job"]["metadata"]["name"]
    assert named.endswith("-a1b2")


def test_work_dir_mounts_follow_params_paths():
    """One claim, mounted under the repo where each top folder of ``paths.*`` and DVC's cache live."""
    job = by_kind(training_job(cluster_data(2), "phase1"))["Job"]
    work = {m["mountPath"]: m["subPath"] for m in container(job)["volumeMounts"] if m["name"] == "work"}
    assert work == {
        "/opt/sdforge/.dvc/cache": ".dvc/cache",
        "/opt/sdforge/checkpoints": "checkpoints",
        "/opt/sdforge/data": "data",
        "/opt/sdforge/eval": "eval",
        "/opt/sdforge/evaluations": "evaluations",
        "/opt/sdforge/metrics": "metrics",
        "/opt/sdforge/models": "models",
        "/opt/sdforge/runs": "runs",
    }
    claims = {v["name"]: v.get("persistentVolumeClaim") for v in job["spec"]["template"]["spec"]["volumes"]}
    assert claims["work"] == {"claimName": "sdforge-work"}


@pytest.mark.parametrize("deployment", sorted(deployments()))
def test_each_deployment_gets_a_valid_flow_pod(deployment):
    """The Job the Kubernetes worker creates for a run of each cluster deployment."""
    params = parse_params(cluster_data(2))
    manifest = render_flow_job(pool_template(params), deployments()[deployment], flow_run_name="clever-otter")
    pod = manifest["spec"]["template"]["spec"]
    assert {pod.pop(k) for k in PREFECT_QUIRK_KEYS} == {1}  # prefect-kubernetes' own keys (work_pool.py)
    validate(manifest)
    (c,) = pod["containers"]
    want = {"data-prep": 1, "eval": 1}.get(deployment, params.train.nproc_per_node)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == want
    assert c["image"] == IMAGE and c["args"] == ["prefect", "flow-run", "execute"]
    assert {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert pod["serviceAccountName"] == params.cluster.service_account
    assert manifest["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    assert pod["nodeSelector"] == dict(params.cluster.node_selector)
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["MLFLOW_TRACKING_URI"] == params.cluster.mlflow_tracking_uri
    assert env["HF_HOME"] == "/cache/huggingface"


def test_no_credential_reaches_any_manifest(planted_secrets):
    """With AWS keys and an MLflow password in the rendering process's environment, none of their values, and no
    variable named like a credential, is in any manifest (S3 comes from the service account)."""
    text = json.dumps(render_all(cluster_data(4)))
    for value in planted_secrets.values():
        assert value not in text
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN", "PASSWORD", "PREFECT_API_KEY"):
        assert name not in text


def test_render_all_covers_every_phase_and_deployment():
    rendered = render_all(cluster_data(2))
    params = parse_params(cluster_data(2))
    assert {n for n in rendered if n.startswith("train-job-")} == {f"train-job-{p}.yaml" for p in params.phases}
    assert {n for n in rendered if n.startswith("flow-job-")} == {f"flow-job-{d}.yaml" for d in deployments()}
    assert set(deployments()) == {f"phase{i}" for i in range(8)} | {"data-prep", "eval"}


def test_the_namespace_set_up_validates_and_matches_params():
    """deploy/kubernetes/cluster-setup.yaml: valid objects whose names are the full config's cluster names, and a
    role that lets the flow's pod run training jobs (create Jobs, Services, ConfigMaps; read pods and their logs)."""
    objects = list(yaml.safe_load_all((REPO / "deploy/kubernetes/cluster-setup.yaml").read_text()))
    for obj in objects:
        validate(obj)
    cluster = parse_params(yaml.safe_load((REPO / "configs/full/params.yaml").read_text())).cluster
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("Namespace", cluster.namespace), ("ServiceAccount", cluster.service_account)} <= names
    assert {("PersistentVolumeClaim", cluster.work_pvc), ("PersistentVolumeClaim", cluster.cache_pvc)} <= names
    claim = next(o for o in objects if o["metadata"]["name"] == cluster.work_pvc)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    role = next(o for o in objects if o["kind"] == "Role")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}  # fmt: skip
    needed = {("batch", "jobs", "create"), ("", "services", "create"), ("", "configmaps", "create"),
              ("", "pods", "list"), ("", "pods/log", "get"), ("batch", "jobs/status", "get")}  # fmt: skip
    assert needed <= granted
