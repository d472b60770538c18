"""Stage ``caption_images``: a local captioner folder keyed by its files, the parquet's columns, a source without
``recaption``, MLflow's progress, table and histogram, and a SIGKILL mid-stage resumed through the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pyarrow.parquet as pq
import yaml

from sdforge.captions.store import SCHEMA
from sdforge.config import Recaption, parse_params
from sdforge.demo.models import write_demo_tokenizer
from stages import caption_images
from tests.fixtures.captioner import WORDS, build_tiny_blip, write_shard

REPO = Path(__file__).resolve().parents[2]


def _setup(root: Path, shards: int = 2, per_shard: int = 4) -> tuple[Path, Path]:
    models = root / "models"
    write_demo_tokenizer(WORDS + ["img", "jpg"], models / "tokenizer", 77)
    build_tiny_blip(models / "blip")
    for shard in range(shards):
        write_shard(root / "shards" / "web", shard, per_shard)
    return models, root / "shards" / "web"


def _rec(models: Path, **kw) -> Recaption:
    return Recaption(model=str(models / "blip"), generation={"max_new_tokens": 6}, batch_size=4, **kw)


def test_the_stage_writes_every_column_and_keys_a_local_model_on_its_files(tmp_path):
    models, shards = _setup(tmp_path)
    out = tmp_path / "captions" / "web"
    first = caption_images.run(_rec(models), shards, models, out)
    assert (first["enabled"], first["shards"], first["images"], first["run.captioned"]) == (True, 2, 8, 8)
    table = pq.read_table(out / "00000.parquet")
    assert table.schema.names == SCHEMA.names and table.num_rows == 4
    row = table.to_pylist()[0]
    assert row["model"] == str(models / "blip") and row["revision"].startswith("sha256:")
    assert row["tokens"] >= 2 and row["truncated"] is False and row["original_caption"] == "IMG_0_0.jpg"
    assert first["synthetic"] + first["rejected"] == 8
    again = caption_images.run(_rec(models), shards, models, out)
    assert (again["run.shards_skipped"], again["run.captioned"]) == (2, 0)
    build_tiny_blip(models / "blip", seed=1)  # the captioner retrained: its files changed
    retrained = caption_images.run(_rec(models), shards, models, out)
    assert (retrained["run.captioned"], retrained["run.stale"]) == (8, 8)
    settings = json.loads((out / caption_images.SETTINGS_FILE).read_text())
    assert settings["revision"] != row["revision"]  # the new folder's digest
    assert {r["settings"] for r in pq.read_table(out / "00001.parquet").to_pylist()} == {settings["fingerprint"]}


def test_a_source_without_recaption_keeps_no_captions(tmp_path):
    models, shards = _setup(tmp_path, shards=1)
    out = tmp_path / "captions" / "web"
    caption_images.run(_rec(models), shards, models, out)
    metrics = caption_images.run(None, shards, models, out)
    assert metrics == {"enabled": False, "shards_removed": 1}
    assert not list(out.glob("*.parquet"))
    assert json.loads((out / caption_images.SETTINGS_FILE).read_text()) == {"recaption": None}


def _params(root: Path, models: Path) -> dict:
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["paths"] = {k: str(root / Path(v).name) for k, v in data["paths"].items()}
    data["paths"]["models"] = str(models)
    data["tracking"]["mlflow_uri"] = f"sqlite:///{root / 'mlflow.db'}"
    data["sources"]["web"] = {**data["sources"]["concept"], "recaption": _rec(models).model_dump()}
    return data


def test_mlflow_gets_progress_a_table_with_images_and_the_length_histogram(tmp_path):
    models, _ = _setup(tmp_path, shards=3, per_shard=3)
    params = parse_params(_params(tmp_path, models))
    metrics = caption_images.run_stage(params, "web")
    assert metrics["images"] == 9
    mlflow.set_tracking_uri(params.tracking.mlflow_uri)
    run = mlflow.search_runs(experiment_names=["sdforge"], filter_string="tags.`sdforge.stage` = 'caption_images@web'")
    run_id = run.iloc[0]["run_id"]
    client = mlflow.MlflowClient()
    progress = client.get_metric_history(run_id, "progress.progress")
    assert [round(m.value, 3) for m in progress] == [0.333, 0.667, 1.0]
    assert [m.step for m in progress] == [3, 6, 9]  # images captioned so far
    local = Path(client.download_artifacts(run_id, "caption_images", str(tmp_path / "artifacts")))
    table = json.loads((local / "web_samples.json").read_text())
    assert len(table["data"]) == 9 and "image" in table["columns"] and "synthetic_caption" in table["columns"]
    assert (local / "web_tokens.png").stat().st_size > 1000


def test_a_sigkill_mid_stage_resumes_without_recaptioning_finished_shards(tmp_path):
    shards = 8  # the kill waits for the 2nd parquet: the other 6 must not all finish before it lands (4 did once)
    models, _ = _setup(tmp_path, shards=shards, per_shard=4)
    data = _params(tmp_path, models)
    data["sources"]["web"]["recaption"]["batch_size"] = 2
    data["tracking"]["enabled"] = False
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(data))
    cmd = [sys.executable, "-m", "stages.caption_images", "--params", str(params_file), "--item", "web"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "captions" / "web"
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (out / "00001.parquet").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = sorted(p.name for p in out.glob("*.parquet"))
    assert 1 <= len(done) < shards, done  # killed mid-stage, no torn file
    subprocess.run(cmd, cwd=tmp_path, env=env, check=True, capture_output=True, timeout=300)
    metrics = json.loads((tmp_path / "metrics" / "caption_images" / "web.json").read_text())
    assert metrics["run.shards_skipped"] == len(done) and metrics["run.captioned"] == 4 * (shards - len(done))
    assert metrics["images"] == 4 * shards
