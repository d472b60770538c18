"""`python -m tools.stack up --with-s3 --mlflow` (what `make stack-up-s3` runs), on free ports against a
mini project: moto's S3 server, the MLflow server with its artifacts on S3, Prefect server + worker; a
deployment run pushes its stages to the DVC remote that `up` configured; `down` stops everything."""

from __future__ import annotations

import urllib.request

import pytest

from tests.flows.conftest import free_port, make_mini_project

pytestmark = pytest.mark.slow


def test_stack_up_with_s3_and_mlflow(tmp_path, monkeypatch):
    import boto3
    import mlflow

    from tools.stack import LOCAL_BUCKET, Stack

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    stack = Stack(
        root=make_mini_project(tmp_path / "project"), home=tmp_path / "home", state_dir=tmp_path / "state",
        port=free_port(), query_seconds=1, with_s3=True, s3_port=free_port(), with_mlflow=True,
        mlflow_port=free_port(),
    )
    try:
        stack.up("phase1")
        env_file = (tmp_path / "state/env").read_text()
        assert f"AWS_ENDPOINT_URL={stack.s3_endpoint}" in env_file and "MLFLOW_TRACKING_URI" in env_file
        assert "AWS_SECRET_ACCESS_KEY" not in env_file
        assert f"s3://{LOCAL_BUCKET}/dvcstore" in (stack.root / ".dvc/config.local").read_text()

        run = stack.prefect("deployment", "run", "train-phase/phase1", "--watch", "--watch-timeout", "180")
        assert "Completed" in run.stdout, run.stdout[-3000:]
        s3 = boto3.client(
            "s3", endpoint_url=stack.s3_endpoint, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
        )
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=LOCAL_BUCKET).get("Contents", [])]
        assert any(k.startswith("dvcstore/files/md5/") for k in keys), keys  # the worker's run pushed

        # an MLflow client needs only the tracking URI: the artifact goes through the server to S3
        monkeypatch.setenv("MLFLOW_TRACKING_URI", stack.mlflow_url)
        with mlflow.start_run() as run:
            mlflow.log_text("hello", "note.txt")
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=LOCAL_BUCKET, Prefix="mlflow/").get("Contents", [])]
        assert any(k.endswith(f"{run.info.run_id}/artifacts/note.txt") for k in keys), keys
        pids = {name: stack.pid(name) for name in ("server", "worker", "mlflow", "s3")}
        assert all(pids.values()), pids
    finally:
        stack.down()
    assert not any(stack.pid(name) for name in pids)
    with pytest.raises(OSError):
        urllib.request.urlopen(f"{stack.mlflow_url}/health", timeout=2)
