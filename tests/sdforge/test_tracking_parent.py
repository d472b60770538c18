"""Parent runs summarise their stages: headline metrics, params, artifacts and a description in DAG order;
changed parent params start a new parent run; the experiment opens as model training."""

from __future__ import annotations

import re

import pytest

from sdforge.config import Tracking
from sdforge.tracking import (
    EXPERIMENT_KIND_TAG,
    MODEL_TRAINING,
    NOTE_TAG,
    PARENT_TAG,
    log_stage,
    stage_run,
    summarise,
    with_section,
)


@pytest.fixture
def store(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A SQLite MLflow store in ``tmp_path`` and a client on it."""
    import mlflow

    monkeypatch.chdir(tmp_path)  # the sqlite store's default artifact root is ./mlruns
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # spool off: these tests read the store right after each log (the spool's replay: test_tracking_spool.py)
    return Tracking(mlflow_uri=uri, experiment="parents", spool=False), mlflow.MlflowClient(tracking_uri=uri)


def _parents(client, name: str) -> list:
    exp = client.get_experiment_by_name("parents")
    return client.search_runs(
        [exp.experiment_id], f"tags.`{PARENT_TAG}` = '{name}'", order_by=["attributes.start_time DESC"]
    )


def test_phase_parent_carries_params_headline_metrics_artifact_and_ordered_note(store, tmp_path):
    cfg, client = store
    phase = {"phase": {"lr": 1e-4, "mix": {"laion": 1.0}}}
    grid = tmp_path / "grid.png"
    grid.write_bytes(b"\x89PNG fake")
    # logged out of DAG order on purpose: the description still reads mix, train, eval
    with stage_run(cfg, "phase1", "eval_grid", {"steps": 20}, phase) as mlflow:
        mlflow.log_metric("colour_agreement_seen", 0.9375)
        summarise(mlflow, metrics={"colour_agreement_seen": 0.9375}, note="**Eval** section", artifacts=[(grid, None)])
    with stage_run(cfg, "phase1", "train", None, phase) as mlflow:
        for step, loss in ((10, 0.5), (20, 0.25)):
            summarise(mlflow, metrics={"loss": loss}, step=step)
        summarise(mlflow, metrics={"final_loss": 0.125}, note="**Training** section")
    with stage_run(cfg, "phase1", "mix_phase", None, phase) as mlflow:
        summarise(mlflow, metrics={"samples": 480}, note="### phase1\n\n**Data** section")

    (parent,) = _parents(client, "phase1")
    data = parent.data
    assert data.params == {"phase.lr": "0.0001", "phase.mix.laion": "1.0"}
    assert data.metrics == {
        "eval_grid.colour_agreement_seen": 0.9375,
        "train.loss": 0.25,
        "train.final_loss": 0.125,
        "mix_phase.samples": 480.0,
    }
    history = client.get_metric_history(parent.info.run_id, "train.loss")
    assert [(m.step, m.value) for m in history] == [(10, 0.5), (20, 0.25)]
    assert _visible(data.tags[NOTE_TAG]) == "### phase1\n\n**Data** section\n\n**Training** section\n\n**Eval** section"
    assert not [k for k in data.tags if k.startswith("sdforge.note")]  # the Tags panel stays readable
    assert [a.path for a in client.list_artifacts(parent.info.run_id)] == ["grid.png"]
    children = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert sorted(r.data.tags["sdforge.stage"] for r in children) == ["eval_grid", "mix_phase", "train"]
    assert client.get_experiment(parent.info.experiment_id).tags[EXPERIMENT_KIND_TAG] == MODEL_TRAINING


def test_changed_parent_params_start_a_new_parent_run_and_keep_the_old(store):
    """An LR change reruns train and eval_grid, not mix_phase: the new parent starts with mix_phase's summary."""
    cfg, client = store
    with stage_run(cfg, "phase2", "mix_phase", None, {"phase": {"lr": 1e-4}}) as mlflow:
        summarise(mlflow, metrics={"samples": 48}, note="**Data** 48")
    for lr in (1e-4, 1e-4, 2e-4):
        with stage_run(cfg, "phase2", "train", None, {"phase": {"lr": lr}}) as mlflow:
            summarise(mlflow, metrics={"final_loss": lr * 1000}, note=f"**Training** {lr}")
    newest, old = _parents(client, "phase2")
    assert newest.data.params == {"phase.lr": "0.0002"}
    assert newest.data.metrics == {"mix_phase.samples": 48.0, "train.final_loss": 0.2}
    assert _visible(newest.data.tags[NOTE_TAG]) == "**Data** 48\n\n**Training** 0.0002"
    assert old.data.params == {"phase.lr": "0.0001"}
    assert old.data.metrics == {"mix_phase.samples": 48.0, "train.final_loss": 0.1}
    children_of_old = client.search_runs([old.info.experiment_id], f"tags.`mlflow.parentRunId` = '{old.info.run_id}'")
    assert len(children_of_old) == 3


def test_data_stages_log_headline_per_source_and_one_line_each(store):
    cfg, client = store
    for source, rows in (("laion", 530), ("diffusiondb", 192)):
        metrics = {"rows_in": rows, "rows_out": rows - 2, "files": 1, "ok": True}
        log_stage(cfg, "data", f"filter_metadata@{source}", metrics, headline=("rows_in", "rows_out", "ok"),
                  note=f"- filter `{source}`")
    log_stage(cfg, "data", "make_demo_data", {"good_rows": 480}, headline=("good_rows",), note="**Demo corpus**")
    (parent,) = _parents(client, "data")
    assert parent.data.metrics == {
        "filter_metadata.laion.rows_in": 530.0,
        "filter_metadata.laion.rows_out": 528.0,
        "filter_metadata.diffusiondb.rows_in": 192.0,
        "filter_metadata.diffusiondb.rows_out": 190.0,
        "make_demo_data.good_rows": 480.0,
    }
    # DAG order first (make_demo_data before filter_metadata), then the stage@source names
    assert _visible(parent.data.tags[NOTE_TAG]) == "**Demo corpus**\n\n- filter `diffusiondb`\n\n- filter `laion`"


def test_a_stage_replaces_its_own_section_and_keeps_the_users_words():
    note = with_section("My notes.", "07.train", "old training")
    note = with_section(note, "06.mix_phase", "data")
    note = with_section(note, "07.train", "new training")
    assert _visible(note) == "My notes.\n\ndata\n\nnew training"


def _visible(note: str) -> str:
    """The description as the MLflow UI renders it: the section markers (HTML comments) are invisible."""
    return re.sub(r"<!-- sdforge:\S+ -->\n", "", note)


def test_summarise_does_nothing_when_tracking_is_off(tmp_path):
    cfg = Tracking(enabled=False, mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    with stage_run(cfg, "phase1", "train", None, {"phase": {"lr": 1.0}}) as mlflow:
        summarise(mlflow, metrics={"loss": 1.0}, note="x", artifacts=[(tmp_path / "missing.png", None)])
    assert not (tmp_path / "mlflow.db").exists()
