"""Flow parameters (force_stage, the eval flow) and what each run publishes (artifacts, progress)."""

from __future__ import annotations

import textwrap
import time

import pytest

from tests.flows.conftest import artifacts_of, make_mini_project


def test_force_stage_reruns_that_stage_only(mini_project, prefect_api, monkeypatch):
    from flows.train_phase import train_phase

    monkeypatch.chdir(mini_project)
    assert train_phase(phase="phase1")["ran"] == ["prepare", "mix_phase@phase1", "eval_grid@phase1"]
    forced = train_phase(phase="phase1", force_stage="prepare")
    assert forced["ran"] == ["prepare"]
    assert forced["skipped"] == ["mix_phase@phase1", "eval_grid@phase1"]  # same output: dependants unchanged
    with pytest.raises(ValueError, match="force_stage 'train@phase1' is not among the stages"):
        train_phase(phase="phase1", force_stage="train@phase1")


def test_eval_flow_forces_the_grid_of_a_phase(mini_project, prefect_api, monkeypatch):
    from flows.eval import eval_phase

    monkeypatch.chdir(mini_project)
    first = eval_phase(phase="phase2")
    assert first["ran"] == ["prepare", "mix_phase@phase2", "eval_grid@phase2"]
    again = eval_phase(phase="phase2")
    assert again["ran"] == ["eval_grid@phase2"] and again["skipped"] == ["prepare", "mix_phase@phase2"]


BAR_DVC_YAML = textwrap.dedent(
    """\
    stages:
      eval_grid:
        foreach: ${phases}
        do:
          cmd: python bar.py > grid-${key}.txt
          outs:
            - grid-${key}.txt
    """
)

BAR = textwrap.dedent(
    """\
    import sys
    for i in range(201):
        sys.stderr.write(f"\\rgrid: {i // 2}%|#    | {i}/200 [00:0{i % 10}<00:00, 9.0it/s]")
    sys.stderr.write("\\n")
    print("done")
    """
)


def test_progress_bars_become_a_progress_artifact_not_log_lines(tmp_path, prefect_api, monkeypatch):
    from prefect.client.orchestration import get_client

    from flows.train_phase import train_phase

    project = make_mini_project(tmp_path / "project", BAR_DVC_YAML)
    (project / "bar.py").write_text(BAR)
    monkeypatch.chdir(project)
    state = train_phase(phase="phase1", return_state=True)
    assert state.result()["ran"] == ["eval_grid@phase1"]
    run_id = state.state_details.flow_run_id
    artifacts = artifacts_of(run_id)
    assert artifacts["progress-eval-grid-phase1"].data == 100.0
    assert artifacts["progress"].data == 100.0  # the flow's own: stages done / stages
    assert "**ran**" in artifacts["stage-eval-grid-phase1"].data
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        for _ in range(40):  # logs reach the API in batches, a moment after the run
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])), limit=200)
            if any("stage eval_grid@phase1: ran" in log.message for log in logs):
                break
            time.sleep(0.5)
    bar_lines = [log.message for log in logs if "/200 [" in log.message]
    assert 1 <= len(bar_lines) <= 3 and bar_lines[-1].startswith("grid: 100%")  # not 201 lines
