"""The train-phase flow in this process, and the deployments through a real server + process worker."""

from __future__ import annotations

import pytest


def test_train_phase_runs_stages_in_order_then_skips_them(mini_project, prefect_api, monkeypatch):
    from flows.train_phase import train_phase

    monkeypatch.chdir(mini_project)
    first = train_phase(phase="phase2")
    assert first["stages"] == ["prepare", "mix_phase@phase2", "eval_grid@phase2"]
    assert first["ran"] == first["stages"]
    assert (mini_project / "grid-phase2.txt").read_text() == "mix phase2\ngrid phase2\n"
    assert not (mini_project / "unrelated.txt").exists()
    assert not (mini_project / "grid-phase1.txt").exists()

    second = train_phase(phase="phase2")
    assert second["skipped"] == second["stages"] == first["stages"]
    assert second["ran"] == second["restored"] == []


def test_dry_run_lists_without_running(mini_project, prefect_api, monkeypatch):
    from flows.train_phase import train_phase

    monkeypatch.chdir(mini_project)
    summary = train_phase(phase="phase1", dry_run=True)
    assert summary["stages"] == ["prepare", "mix_phase@phase1", "eval_grid@phase1"]
    assert "ran" not in summary
    assert not (mini_project / "prepared.txt").exists()


def test_unknown_phase_is_rejected_with_the_known_ones(mini_project, prefect_api, monkeypatch):
    from flows.train_phase import train_phase

    monkeypatch.chdir(mini_project)
    with pytest.raises(ValueError, match=r"phase must be one of phase1, phase2 .*got 'phase9'"):
        train_phase(phase="phase9")


def test_network_stages_get_retries():
    from flows.tasks import NETWORK_RETRIES, stage_task

    assert stage_task("download_metadata@laion").retries == NETWORK_RETRIES
    assert stage_task("fetch_images@diffusiondb").retries == NETWORK_RETRIES
    assert stage_task("eval_grid@phase1").retries == 0
    assert stage_task("prepare_models").retries == 0


def test_a_train_stage_is_retried_only_when_preempted_or_hung():
    """Exit 75 (preempted) and 76 (hang watchdog) retry — the stage resumes from its checkpoint; a crash does not."""
    from flows.dvc_ops.runner import StageFailed
    from flows.tasks import TRAIN_RETRIES, _retryable_train_failure, stage_task

    task = stage_task("train@phase7")
    assert task.retries == TRAIN_RETRIES and task.retry_condition_fn is _retryable_train_failure

    class Failed:
        def __init__(self, err):
            self.err = err

        def result(self):
            raise self.err

    def dvc_failure(status: int) -> StageFailed:
        line = f"ERROR: failed to reproduce 'train@phase7': failed to run: python -m stages.train, exited with {status}"
        return StageFailed(f"dvc repro --single-item train@phase7 exited 1; last output:\n{line}")

    assert _retryable_train_failure(task, None, Failed(dvc_failure(75)))
    assert _retryable_train_failure(task, None, Failed(dvc_failure(76)))
    assert not _retryable_train_failure(task, None, Failed(dvc_failure(1)))
    assert not _retryable_train_failure(task, None, Failed(dvc_failure(2)))
    assert not _retryable_train_failure(task, None, Failed(RuntimeError("exited with 75")))


def test_deployment_runs_through_the_worker_in_the_deploying_project(prefect_stack):
    """`prefect deploy --all` of the repo's prefect.yaml from a mini project, then
    `prefect deployment run train-phase/phase1 --watch`: the worker's flow run must work in that project."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    project = prefect_stack.root
    run = prefect_stack.prefect("deployment", "run", "train-phase/phase1", "--watch", "--watch-timeout", "90")
    assert "Completed" in run.stdout, run.stdout[-3000:]
    assert (project / "grid-phase1.txt").read_text() == "mix phase1\ngrid phase1\n"
    assert (project / "dvc.lock").exists()

    with temporary_settings(updates={PREFECT_API_URL: prefect_stack.api_url}):
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("train-phase/phase1")
            runs = client.read_flow_runs()
    # `prefect deploy` filled in {{ $SDFORGE_ROOT }}: the deployment runs in the clone that deployed it
    assert deployment.pull_steps == [
        {"prefect.deployments.steps.set_working_directory": {"directory": str(project)}}
    ]
    assert deployment.parameters == {"phase": "phase1"}
    finished = [r for r in runs if r.deployment_id == deployment.id]
    assert [r.state.type.value for r in finished] == ["COMPLETED"]
