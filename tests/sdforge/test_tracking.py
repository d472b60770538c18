"""MLflow params logging never carries a secret: secret-named keys and URL credentials become ``***``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdforge.config import ConfigError, Tracking
from sdforge.eval.export import register
from sdforge.tracking import flatten, flush_spool, log_stage

SENTINEL = "SENTINELs3cr3t"
"""Stands for a credential: it must never reach MLflow."""


def _leaky_params() -> dict:
    return {
        "storage": {"dvc_remote": f"s3://AKIAEXAMPLE:{SENTINEL}@bucket/dvcstore", "remote_name": "storage"},
        "train": {"checkpoint_s3": f"s3://AKIAEXAMPLE:{SENTINEL}/with/slash@bucket/ckpts", "lr": 1e-4},
        "aws_secret_access_key": SENTINEL,
        "hub": {"HF_TOKEN": SENTINEL, "db_password": SENTINEL, "ClientSecret": SENTINEL},
        "mirrors": [f"https://user:{SENTINEL}@mirror.example.com/x", "s3://plain-bucket/x"],
        "endpoint": f"minio:{SENTINEL}@minio:9000",
        "tracking": {"mlflow_uri": f"postgresql://mlflow:{SENTINEL}@db:5432/mlflow"},
    }


def test_flatten_redacts_secret_keys_and_url_credentials():
    flat = flatten(_leaky_params())
    assert SENTINEL not in repr(flat)
    assert flat["aws_secret_access_key"] == flat["hub.HF_TOKEN"] == flat["hub.db_password"] == "***"
    assert flat["hub.ClientSecret"] == "***"
    assert flat["storage.dvc_remote"] == "s3://***@bucket/dvcstore"
    assert flat["tracking.mlflow_uri"] == "postgresql://***@db:5432/mlflow"
    assert flat["endpoint"] == "***@minio:9000"
    assert "s3://plain-bucket/x" in flat["mirrors"]
    assert flat["storage.remote_name"] == "storage" and flat["train.lr"] == "0.0001"  # the rest is kept


def test_flatten_keeps_plain_values():
    params = {"phase": {"lr": 1e-5, "mix": {"laion": 0.6}}, "prompts": ["a photo of me@home"], "uri": "sqlite:///m.db"}
    assert flatten(params) == {
        "phase.lr": "1e-05",
        "phase.mix.laion": "0.6",
        "prompts": "['a photo of me@home']",
        "uri": "sqlite:///m.db",
    }


def test_sentinel_never_reaches_mlflow(tmp_path, monkeypatch: pytest.MonkeyPatch):
    import mlflow

    monkeypatch.chdir(tmp_path)  # the sqlite store's default artifact root is ./mlruns
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = Tracking(mlflow_uri=uri, experiment="redaction")
    metrics = {"rows": 3, "source": f"https://user:{SENTINEL}@mirror.example.com/x"}
    log_stage(cfg, "data", "download_metadata@laion", metrics, _leaky_params())
    spooled = [p.read_bytes() for p in (tmp_path / "mlflow.db.spool").rglob("*") if p.is_file()]
    assert len(spooled) >= 2 and all(SENTINEL.encode() not in data for data in spooled)  # the spool is redacted too
    assert flush_spool(cfg) == 1

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("redaction")
    (run,) = client.search_runs([exp.experiment_id], filter_string="tags.`sdforge.stage` = 'download_metadata@laion'")
    params = run.data.params
    assert params["aws_secret_access_key"] == "***" and params["storage.dvc_remote"] == "s3://***@bucket/dvcstore"
    assert params["train.lr"] == "0.0001"
    assert SENTINEL not in repr(params) and SENTINEL not in repr(run.data.tags)
    artifact = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, tracking_uri=uri, dst_path=str(tmp_path / "a")
    )
    texts = [p.read_text() for p in (tmp_path / "a").rglob("*") if p.is_file()]
    assert texts and artifact and all(SENTINEL not in t for t in texts)
    assert SENTINEL not in (tmp_path / "mlflow.db").read_bytes().decode("latin-1")


def test_tracking_off_logs_nothing_and_never_imports_mlflow(tmp_path):
    """``tracking.enabled: false``: a stage's logging calls are dropped; no store is created, mlflow is not imported."""
    code = (
        "import sys\n"
        "from sdforge.config import Tracking\n"
        "from sdforge.tracking import NULL_TRACKING, log_stage, stage_run\n"
        f"cfg = Tracking(enabled=False, mlflow_uri='sqlite:///{tmp_path}/mlflow.db')\n"
        "log_stage(cfg, 'phase1', 'train', {'loss': 0.5}, {'lr': 1})\n"
        "with stage_run(cfg, 'phase1', 'train') as m:\n"
        "    assert m is NULL_TRACKING and m.active_run() is None\n"
        "    m.log_metrics({'a': 1.0}, step=3); m.log_image(None, artifact_file='x.png'); m.set_tag('k', 'v')\n"
        "print('mlflow' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert out.stdout.strip() == "False"
    assert list(tmp_path.iterdir()) == []


def test_registering_needs_tracking(tmp_path):

    with pytest.raises(ConfigError, match="tracking.enabled: true"):
        register(tmp_path, "sdforge-demo", Tracking(enabled=False), {})
