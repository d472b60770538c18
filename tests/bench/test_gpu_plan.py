"""The GPU session's plan, checked without a GPU: the full-size train check's schedule and workspace params."""

from __future__ import annotations

from bench._common import result_line
from bench.gpu import workspace
from bench.gpu.train_check import plan
from bench.gpu.workspace import TINY_UNET
from sdforge.config import parse_params


def test_kill_lands_between_checkpoints_in_both_plans():
    for quick, steps, save, kill, resume in ((False, 120, 30, 75, 60), (True, 40, 10, 25, 20)):
        p = plan(quick, None, None)
        assert (p["steps"], p["train"]["save_steps"], p["kill_at"], p["resume_from"]) == (steps, save, kill, resume)
        assert p["resume_from"] < p["kill_at"] < p["resume_from"] + save
        assert p["samples"] == p["steps"] * p["batch"] and p["phase"]["epochs"] == 1
        assert p["train"]["keep_last"] == 1 and p["train"]["deterministic"] is True


def test_full_workspace_params_parse_with_the_sd_unet(tmp_path):
    p = plan(False, None, None)
    params = parse_params(workspace.workspace_params(tmp_path, p["unet"], p["samples"], p["train"], p["phase"]))
    assert params.models.unet.block_out_channels == [320, 640, 1280, 1280] and params.models.unet.sample_size == 64
    assert params.models.text_encoder_build.hidden_size == 768  # the UNet's cross_attention_dim
    assert params.tracking.enabled is False and params.train.validation_every == 0
    assert list(params.phases) == ["phase1"] and params.phases["phase1"].samples == 960
    assert all(str(tmp_path) in str(path) for path in params.paths.model_dump().values())
    assert plan(True, None, None)["unet"] == TINY_UNET


def test_result_line_writes_booleans_bare():
    line = result_line("train_check", 1.5, ok=True, bit_identical=False, device="cuda")
    assert line == 'RESULT name=train_check ratio=1.5 ok=true bit_identical=false device="cuda"'
