"""train stage: MLflow step metrics (keys, sane values, data-wait measured) and init from foreign weights."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from sdforge.config import parse_params
from sdforge.io import InputError
from tests.fixtures.training import untrained_clone

LOADER_DELAY_S = 0.05


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, straight_phase1) -> Path:
    return untrained_clone(straight_phase1, tmp_path_factory.mktemp("tracking"))


def _params(params_file: Path, **phase1):
    data = yaml.safe_load(params_file.read_text())
    data["train"]["log_every"] = 2
    data["phases"]["phase1"].update(phase1)
    return parse_params(data)


def test_step_metrics_logged_every_n_steps(workspace, monkeypatch):
    import mlflow

    from sdforge.training import step
    from stages import train

    slow_batches = step.iter_batches

    def slow_loader(*args, **kwargs):
        for item in slow_batches(*args, **kwargs):
            time.sleep(LOADER_DELAY_S)
            yield item

    monkeypatch.setattr(step, "iter_batches", slow_loader)
    monkeypatch.setenv("SDFORGE_PROGRESS", "0")
    params = _params(workspace, epochs=1)  # 5 batches of 8, accum 2 → 3 optimizer steps; logged at step 2
    metrics = train.run_stage(params, "phase1")
    assert metrics["steps"] == 3

    mlflow.set_tracking_uri(params.tracking.mlflow_uri)
    client = mlflow.MlflowClient()
    exp = client.get_experiment_by_name(params.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id], filter_string="tags.`sdforge.stage` = 'train'")
    keys = {"loss", "lr", "grad_norm", "step_time_s", "data_wait_s", "samples_per_s"}
    assert keys <= set(run.data.metrics)
    assert "gpu_mem_max_allocated_gb" not in run.data.metrics  # CPU
    for key in keys:
        assert [m.step for m in client.get_metric_history(run.info.run_id, key)] == [2], key
    m = run.data.metrics
    assert m["loss"] > 0 and m["grad_norm"] > 0 and 0 < m["lr"] <= 1e-3
    assert 2 * LOADER_DELAY_S <= m["data_wait_s"] <= m["step_time_s"]  # 2 micro-batches waited on per step
    assert m["samples_per_s"] == pytest.approx(16 / m["step_time_s"], rel=1e-6)  # mean of 2 steps of 16 samples
    p = run.data.params
    assert p["phase.lr"] == "0.001" and p["phase.grad_accum"] == "2" and p["train.log_every"] == "2"
    assert p["run.world"] == "1" and p["run.total_steps"] == "3"


def _foreign(unet, wrap) -> dict:
    return wrap({f"module._orig_mod.{k}": v.clone() + 1 for k, v in unet.state_dict().items()})


@pytest.mark.parametrize(
    ("name", "wrap"),
    [("a.safetensors", lambda sd: sd), ("b.pt", lambda sd: {"state_dict": {"ema": sd}, "step": 5})],
)
def test_phase_init_path_loads_foreign_weights(workspace, tmp_path, name, wrap):
    from sdforge.training.distributed import init_distributed
    from sdforge.training.job import TrainJob
    from sdforge.training.unet_init import load_init_unet

    params = _params(workspace)
    base = load_init_unet(Path(params.paths.checkpoints) / "scratch", "live", params.models.unet.model_dump())
    path = tmp_path / name
    sd = _foreign(base, wrap)
    save_file(sd, path) if name.endswith(".safetensors") else torch.save(sd, path)
    job = TrainJob(_params(workspace, init_path=str(path)), "phase1", init_distributed())
    for k, v in base.state_dict().items():
        assert torch.equal(job.model.unet.state_dict()[k], v + 1), k
    shadow, live = job.optim.ema.shadow_params, job.model.unet.parameters()
    assert all(torch.equal(s, p) for s, p in zip(shadow, live, strict=True))


def test_phase_init_path_mismatch_names_keys_and_file(workspace, tmp_path):
    from sdforge.training.distributed import init_distributed
    from sdforge.training.job import TrainJob
    from sdforge.training.unet_init import load_init_unet

    params = _params(workspace)
    base = load_init_unet(Path(params.paths.checkpoints) / "scratch", "live", params.models.unet.model_dump())
    sd = {k: v for k, v in base.state_dict().items() if k != "conv_out.bias"}
    sd["conv_in.weight"] = torch.zeros(1, 1, 1, 1)
    path = tmp_path / "bad.safetensors"
    save_file(sd, path)
    with pytest.raises(InputError) as err:
        TrainJob(_params(workspace, init_path=str(path)), "phase1", init_distributed())
    msg = str(err.value)
    assert str(path) in msg and "1 missing (conv_out.bias)" in msg
    assert "1 shape mismatches (conv_in.weight: [1, 1, 1, 1] vs model [16, 4, 3, 3])" in msg
    with pytest.raises(InputError, match="no such file"):
        TrainJob(_params(workspace, init_path=str(tmp_path / "nope.pt")), "phase1", init_distributed())


def test_a_failed_run_ends_failed_in_mlflow_with_the_reason(workspace, tmp_path, monkeypatch):
    """Issue 37: a phase that fails shows FAILED (it showed FINISHED), the error as the end reason."""
    import mlflow

    from sdforge.training.hooks import Hook
    from sdforge.training.reporting import TrackingHook
    from stages import train
    from tests.fixtures.training import clone_workspace

    class Boom(Hook):
        def after_step(self, job, report):
            if report.step == 2:
                raise RuntimeError("boom at step 2")

    monkeypatch.setenv("SDFORGE_PROGRESS", "0")
    params = _params(clone_workspace(workspace.parent, tmp_path))
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)  # an earlier test's run: this one starts afresh
    tracking = TrackingHook(params, "phase1", Path(params.paths.runs) / "phase1")
    with pytest.raises(RuntimeError, match="boom at step 2"):
        train.run(params, "phase1", hooks=[tracking, Boom()])
    client = mlflow.MlflowClient(params.tracking.mlflow_uri)
    exp = client.get_experiment_by_name(params.tracking.experiment)
    run = client.search_runs([exp.experiment_id], filter_string="tags.`sdforge.stage` = 'train'",
                             order_by=["attributes.start_time DESC"])[0]  # fmt: skip
    assert run.info.status == "FAILED"
    assert run.data.tags["sdforge.end_reason"].startswith("RuntimeError: boom at step 2 (at ")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [2]  # logged before it failed
