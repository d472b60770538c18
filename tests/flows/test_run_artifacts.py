"""What a flow run publishes about its stages: the stage table, the failure artifact, MLflow run links."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flows.dvc_ops.runner import StageFailed
from flows.run_artifacts import StageRow, failure_markdown, stage_run_url
from flows.train_phase import train_phase
from sdforge.config import Tracking
from sdforge.tracking import MLFLOW_PARENT_TAG, PARENT_TAG, STAGE_TAG, run_url
from tests.flows.conftest import MINI_DVC_YAML, artifacts_of, make_mini_project

PHASE1 = ["prepare", "mix_phase@phase1", "eval_grid@phase1"]
TABLE = "stages-eval-grid-phase1"

MIX_CMD = 'cmd: echo "mix ${key}" > mix-${key}.txt'
assert MIX_CMD in MINI_DVC_YAML
FAILING_DVC_YAML = MINI_DVC_YAML.replace(MIX_CMD, 'cmd: echo "mix marker-${key} before exit" && exit 3')
"""The mini project with a ``mix_phase`` that prints a marker, then exits 3."""


def _run_phase1():
    """``train_phase(phase1)`` in the working directory: its final state and its artifacts by key."""
    state = train_phase(phase="phase1", return_state=True)
    return state, artifacts_of(state.state_details.flow_run_id)


def _rows(artifacts: dict) -> list[dict]:
    return json.loads(artifacts[TABLE].data)


def _outcomes(rows: list[dict]) -> list[tuple[str, str]]:
    return [(r["stage"], r["outcome"]) for r in rows]


def _set_tracking(project: Path, **tracking) -> None:
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["tracking"].update(tracking)
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def test_failing_stage_fails_the_flow_with_its_output_tail(tmp_path, prefect_api, monkeypatch):
    project = make_mini_project(tmp_path / "project", FAILING_DVC_YAML)
    monkeypatch.chdir(project)
    state, artifacts = _run_phase1()
    assert state.is_failed()
    with pytest.raises(StageFailed, match="marker-phase1 before exit"):
        state.result()
    rows = _rows(artifacts)
    assert _outcomes(rows) == [("prepare", "ran"), ("mix_phase@phase1", "failed"), ("eval_grid@phase1", "not run")]
    assert isinstance(rows[1]["seconds"], float) and rows[2]["seconds"] is None
    failure = artifacts["failure-eval-grid-phase1"].data
    assert "**mix_phase@phase1** failed after" in failure and "`StageFailed`" in failure
    assert "Not run: eval_grid@phase1" in failure
    block = failure.split("```\n")[1]  # the fenced output tail
    assert "mix marker-phase1 before exit" in block and "exited with 3" in block


def _mlflow_store(project: Path) -> dict[str, str]:
    """A SQLite MLflow store in ``project`` with stage runs tagged like the stages tag theirs; the URLs
    the table must link to, by stage."""
    import mlflow  # lazy: ~2 s, only for this test

    client = mlflow.MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    exp = client.create_experiment("sdforge")

    def run(start: int, experiment: str = exp, **tags: str) -> str:
        return client.create_run(experiment, start_time=start, tags=tags).info.run_id

    models, phase1, phase2 = (run(1000, **{PARENT_TAG: p}) for p in ("models", "phase1", "phase2"))
    prepare = run(1100, **{STAGE_TAG: "prepare", MLFLOW_PARENT_TAG: models})
    run(2000, **{STAGE_TAG: "eval_grid", MLFLOW_PARENT_TAG: phase1})  # older: not the one
    newest = run(3000, **{STAGE_TAG: "eval_grid", MLFLOW_PARENT_TAG: phase1})
    run(4000, **{STAGE_TAG: "eval_grid", MLFLOW_PARENT_TAG: phase2})  # another phase
    run(5000, client.create_experiment("elsewhere"), **{STAGE_TAG: "eval_grid@phase1"})  # another experiment
    return {"prepare": _run_link(exp, prepare), "mix_phase@phase1": "", "eval_grid@phase1": _run_link(exp, newest)}


def _run_link(experiment_id: str, run_id: str) -> str:
    """sdforge.tracking.run_url's link for ``tracking.ui_url: http://127.0.0.1:5000`` (it may add a view query)."""
    link = run_url(Tracking(ui_url="http://127.0.0.1:5000"), experiment_id, run_id)
    assert link.startswith(f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs/{run_id}")
    return link


def test_stage_table_lists_outcomes_in_order_and_links_the_newest_stage_runs(mini_project, prefect_api, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(mini_project)
    links = _mlflow_store(mini_project)
    _set_tracking(mini_project, enabled=False, mlflow_uri="sqlite:///mlflow.db", ui_url="http://127.0.0.1:5000")
    state, artifacts = _run_phase1()
    assert state.is_completed()
    rows = _rows(artifacts)
    assert _outcomes(rows) == [(s, "ran") for s in PHASE1]
    assert [list(r) for r in rows] == [["stage", "outcome", "seconds", "mlflow"]] * 3
    assert all(isinstance(r["seconds"], float) and r["seconds"] >= 0 for r in rows)
    assert [r["mlflow"] for r in rows] == ["", "", ""]  # tracking.enabled: false: no links
    assert not any(key.startswith("failure-") for key in artifacts)

    _set_tracking(mini_project, enabled=True)
    _, artifacts = _run_phase1()
    rows = _rows(artifacts)
    assert _outcomes(rows) == [(s, "skipped") for s in PHASE1]  # a skipped stage links to the run that made it
    assert {r["stage"]: r["mlflow"] for r in rows} == links
    assert f"MLflow run: [{links['eval_grid@phase1']}]" in artifacts["stage-eval-grid-phase1"].data


def test_failure_markdown_shows_the_last_lines_in_a_fence_longer_than_any_backticks():
    rows = [StageRow("prepare", "ran", 0.5), StageRow("mix_phase@phase1", "failed", 1.5), StageRow("eval_grid@phase1")]
    output = [f"line {i}" for i in range(60)] + ["a ``` fence in the output"]
    exc = StageFailed("dvc repro --single-item mix_phase@phase1 exited 3:\n" + "\n".join(output))
    text = failure_markdown("eval_grid@phase1", rows, exc)
    assert "**mix_phase@phase1** failed after 1.5 s: `StageFailed`" in text
    assert "Not run: eval_grid@phase1" in text
    assert text.endswith("\n````\n" + "\n".join(output[-40:]) + "\n````")
    assert "line 20\n" not in text


def test_no_link_without_the_store_or_when_mlflow_fails(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracking = Tracking(mlflow_uri="sqlite:///mlflow.db")
    assert stage_run_url(tracking, "eval_grid@phase1", tmp_path) is None
    assert not (tmp_path / "mlflow.db").exists()  # looking did not create a store
    (tmp_path / "mlflow.db").write_text("not a database\n")
    assert stage_run_url(tracking, "eval_grid@phase1", tmp_path) is None  # MLflow's error: no link
