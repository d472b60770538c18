"""A pod dies mid-train; a fresh clone (git only + credentials) runs the phase flow again: finished stages
come from the DVC remote on S3 (moto), training resumes from the S3 checkpoint, nothing else reruns.
Then the same through a deployment and the process worker of a real stack with an MLflow server whose
artifacts go to S3, with sentinel credentials that must appear nowhere they could leak to."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.flows.conftest import FAKE_FINGERPRINT, artifacts_of, free_port, fresh_clone, make_remote_project, ran_here

pytestmark = pytest.mark.slow


def _run(phase: str) -> tuple[dict, object, float]:
    from flows.train_phase import train_phase

    t0 = time.monotonic()
    state = train_phase(phase=phase, return_state=True)
    seconds = time.monotonic() - t0
    return state.result(), state.state_details.flow_run_id, seconds


def test_pod_dies_mid_train_and_a_fresh_clone_resumes(tmp_path, moto_s3, prefect_api, monkeypatch):
    from sdforge.training.checkpoints import COMPLETE

    pod1 = make_remote_project(tmp_path / "pod1", moto_s3)
    monkeypatch.chdir(pod1)
    monkeypatch.setenv("FAKE_TRAIN_DIE_AT", "2")
    from flows.train_phase import train_phase

    died = train_phase(phase="phase1", return_state=True)
    assert died.is_failed()
    assert ran_here(pod1) == ["prepare", "mix_phase@phase1", "train@phase1"]
    keys = [o["Key"] for o in moto_s3.client.list_objects_v2(Bucket=moto_s3.bucket)["Contents"]]
    assert f"ckpts/phase1/{FAKE_FINGERPRINT}/checkpoint-00000002/{COMPLETE}" in keys
    assert not any("checkpoint-00000003" in k for k in keys)
    monkeypatch.delenv("FAKE_TRAIN_DIE_AT")

    # a new pod: the git repo, the credentials, nothing else
    pod2 = fresh_clone(pod1, tmp_path / "pod2")
    monkeypatch.chdir(pod2)
    summary, run_id, resume_s = _run("phase1")
    assert summary["pulled"] == summary["restored"] == ["prepare", "mix_phase@phase1"]
    assert summary["ran"] == ["train@phase1", "eval_grid@phase1"]
    assert ran_here(pod2) == ["train@phase1", "eval_grid@phase1"]  # the stage commands that ran here
    train = json.loads((pod2 / "metrics/train/phase1.json").read_text())
    assert train == {"resumed_from_step": 2, "steps": 4}  # from the S3 checkpoint, not from step 0
    assert (pod2 / "grid-phase1.txt").read_text() == "model phase1 after 4 steps\ngrid\n"

    artifacts = artifacts_of(run_id)
    assert "resumed_from_step | 2" in artifacts["stage-train-phase1"].data
    assert "(remote: pulled)" in artifacts["stage-mix-phase-phase1"].data
    assert "| samples | 3 |" in artifacts["stage-mix-phase-phase1"].data
    assert artifacts["progress"].data == 100.0
    table = json.loads(artifacts["stages-eval-grid-phase1"].data)
    assert [(r["stage"], r["outcome"]) for r in table] == [
        ("prepare", "pulled"), ("mix_phase@phase1", "pulled"), ("train@phase1", "ran"), ("eval_grid@phase1", "ran"),
    ]

    # another new pod after the phase finished: everything comes from the remote
    pod3 = fresh_clone(pod1, tmp_path / "pod3")
    monkeypatch.chdir(pod3)
    again, _, restore_s = _run("phase1")
    assert again["pulled"] == again["restored"] == again["stages"]
    assert again["ran"] == [] and ran_here(pod3) == []
    assert json.loads((pod3 / "metrics/train/phase1.json").read_text())["resumed_from_step"] == 2
    print(f"\nresume on pod2 (2 pulled, 2 ran): {resume_s:.1f} s; pod3 (4 pulled): {restore_s:.1f} s")


def _every(read) -> list:
    """Every row of a Prefect client ``read_*`` call (the server returns at most 200 at a time)."""
    rows: list = []
    while batch := read(limit=200, offset=len(rows)):
        rows += batch
    return rows


def _scan(path: Path, needles: list[bytes]) -> list[str]:
    hits = []
    for f in path.rglob("*"):
        if f.is_file() and not f.is_symlink():
            data = f.read_bytes()
            hits += [f"{f}: {n.decode()}" for n in needles if n in data]
    return hits


def test_deployment_on_a_fresh_clone_resumes_and_no_secret_leaks(tmp_path, moto_s3, monkeypatch):
    import mlflow
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from flows.train_phase import train_phase
    from tools.stack import Stack

    key_id, secret = "AKIASENTINEL00000KEY", "SENTINEL-aws-secret-access-key-SECRET"
    needles = [key_id.encode(), secret.encode()]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("FAKE_TRAIN_MLFLOW", "1")  # the fake train logs its params + metrics like stages do
    pod1 = make_remote_project(tmp_path / "pod1", moto_s3)
    pod2 = fresh_clone(pod1, tmp_path / "pod2")  # git only; deployments will run here
    stack = Stack(
        root=pod2, home=tmp_path / "prefect-home", state_dir=tmp_path / "stack", port=free_port(),
        query_seconds=1, with_mlflow=True, mlflow_port=free_port(),
    )
    try:
        stack.up("phase2")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", stack.mlflow_url)
        monkeypatch.chdir(pod1)
        with temporary_settings(updates={PREFECT_API_URL: stack.api_url, PREFECT_HOME: stack.home}):
            first = train_phase(phase="phase2")
        assert first["ran"] == first["stages"]

        t0 = time.monotonic()
        run = stack.prefect("deployment", "run", "train-phase/phase2", "--watch", "--watch-timeout", "300")
        deployed_s = time.monotonic() - t0
        assert "Completed" in run.stdout, run.stdout[-3000:]
        assert ran_here(pod2) == []  # the worker's run restored every stage: none recomputed
        assert (pod2 / "grid-phase2.txt").read_text() == "model phase2 after 4 steps\ngrid\n"
        assert key_id in (Path(f"/proc/{stack.pid('worker')}/environ").read_text())  # the worker has them

        with temporary_settings(updates={PREFECT_API_URL: stack.api_url}):
            with get_client(sync_client=True) as client:
                logs = _every(client.read_logs)
                artifacts = _every(client.read_artifacts)
                flow_runs = _every(client.read_flow_runs)
        messages = "\n".join(log.message for log in logs)
        assert "restore train@phase2: pulled" in messages and "0 ran, 4 restored" in messages
        for key in ("stage-train-phase2", "stage-eval-grid-phase2"):  # both runs link the MLflow run of the output
            versions = [str(a.data) for a in artifacts if a.key == key]
            assert len(versions) == 2 and all(f"{stack.mlflow_url}/#/experiments/" in v for v in versions), versions
        prefect_text = messages + json.dumps([a.data for a in artifacts], default=str)
        prefect_text += json.dumps([r.parameters for r in flow_runs], default=str)

        client = mlflow.MlflowClient(stack.mlflow_url)
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        [train_run] = [r for r in runs if r.data.tags.get("sdforge.stage") == "train@phase2"]
        assert train_run.data.params["train.checkpoint_s3"] == moto_s3.url("ckpts")  # params were logged
        mlflow_text = json.dumps([[r.data.params, r.data.tags] for r in runs])
        objects = moto_s3.client.list_objects_v2(Bucket=moto_s3.bucket)["Contents"]
        assert any(o["Key"].startswith("mlflow/") for o in objects)  # artifacts went through the server to S3
        s3_hits = [
            o["Key"] for o in objects
            if any(n in moto_s3.client.get_object(Bucket=moto_s3.bucket, Key=o["Key"])["Body"].read() for n in needles)
        ]
    finally:
        stack.down()

    for text in (prefect_text, mlflow_text):
        assert key_id not in text and secret not in text
    assert s3_hits == []  # DVC objects, run cache, checkpoints, MLflow artifacts
    # the workspaces (.dvc/config*, dvc.lock, metrics, .git), Prefect's and MLflow's databases, the stack logs
    for where in (pod1, pod2, stack.home, stack.state_dir):
        assert _scan(where, needles) == []
    print(f"\ndeployment run on the fresh clone (4 stages restored): {deployed_s:.1f} s")
