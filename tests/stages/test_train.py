"""train stage: a SIGKILLed run resumes to bit-identical weights; phase init and arch checks."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from sdforge.io import InputError
from sdforge.training.reporting import read_steps
from tests.fixtures.training import TRAIN_UNET, clone_workspace, train, untrained_clone, weights

# Checkpoints of the tiny run (3 optimizer steps per epoch, save_steps 2): steps 2, 3 (epoch end), 4, 6.
# A SIGKILL right after step k resumes from the newest checkpoint before it (k=4: the one at 4).
RESUME_FROM = {3: (2, "epoch 0, step 2 of it"), 4: (4, "epoch 1, step 1 of it"), 5: (4, "epoch 1, step 1 of it")}
KILL_SEED = int(os.environ.get("SDFORGE_KILL_SEED", random.SystemRandom().randrange(2**31)))
KILL_AT = random.Random(KILL_SEED).choice(sorted(RESUME_FROM))


BOOKKEEPING = {"keep_last": 3, "save_steps": 1, "preempt_grace_s": 40.0, "hang_timeout_s": 900.0}
"""Edited between the kill and the rerun: keys that change no weight, so the run must resume (issue 37: such an
edit once deleted the run dir and started the phase afresh)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, straight_phase1):
    straight = straight_phase1
    killed = tmp_path_factory.mktemp("killed")
    p_killed = untrained_clone(straight, killed)
    died = train(p_killed, "phase1", kill_at=KILL_AT)  # a random step after the first checkpoint
    data = yaml.safe_load(p_killed.read_text())
    data["train"].update(BOOKKEEPING)
    p_killed.write_text(yaml.safe_dump(data))
    resumed = train(p_killed, "phase1")
    return straight, killed, died, resumed


def logged_losses(root: Path) -> list[dict[int, float]]:
    """The per-step ``loss`` history of each MLflow ``train`` run in ``root``'s store, oldest run first."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sdforge")
    found = client.search_runs(
        [exp.experiment_id], "tags.`sdforge.stage` = 'train'", order_by=["attributes.start_time"]
    )
    return [{m.step: m.value for m in client.get_metric_history(r.info.run_id, "loss")} for r in found]


def test_sigkill_then_resume_is_bit_identical(runs):
    """Killed at a random step; retention, checkpoint cadence, logging and grace edited; resumed: the weights and
    reports are the uninterrupted run's, and the run dir was never replaced."""
    straight, killed, died, resumed = runs
    why = f"killed at step {KILL_AT} (SDFORGE_KILL_SEED={KILL_SEED} reproduces it)"
    resume_step, where = RESUME_FROM[KILL_AT]
    assert died.returncode == -9, why
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and f"at step {resume_step} ({where})" in resumed.stderr, why
    for sub in ("unet", "unet_ema"):
        a, b = weights(straight, "phase1", sub), weights(killed, "phase1", sub)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), f"{sub} differs after resume"
    m_straight = json.loads((straight / "metrics/train/phase1.json").read_text())
    m_killed = json.loads((killed / "metrics/train/phase1.json").read_text())
    assert m_straight["steps"] == m_killed["steps"] == 6  # 48 samples / (batch 8 × accum 2) = 3 steps × 2 epochs
    assert m_killed["resumed_at_step"] == resume_step, why
    assert m_straight["final_loss"] is not None and np.isfinite(m_straight["final_loss"])
    # the loss tail travels in the checkpoint: a resumed run reports the uninterrupted run's final_loss
    assert m_killed["final_loss"] == m_straight["final_loss"], why
    state = [json.loads((root / "checkpoints/phase1/state.json").read_text()) for root in (straight, killed)]
    assert state[0] == state[1] and state[0]["final_loss"] == m_straight["final_loss"], why
    # the logged loss sequence: the died run's steps up to the checkpoint, then the resumed run's
    (straight_losses,) = logged_losses(straight)
    died_losses, resumed_losses = logged_losses(killed)
    assert sorted(straight_losses) == list(range(1, 7))
    stitched = {k: v for k, v in died_losses.items() if k <= resume_step} | resumed_losses
    assert stitched == straight_losses, why
    # the run dir's steps.jsonl tells the same story without MLflow: every step once, the last line of a step wins
    local = [{k: r["loss"] for k, r in read_steps(root / "runs/phase1").items()} for root in (straight, killed)]
    assert local[0] == local[1] == straight_losses, why
    redone = (killed / "runs/phase1/steps.jsonl").read_text().splitlines()
    assert len(redone) == 6 + KILL_AT - resume_step, why
    assert [p.name for p in (killed / "runs").iterdir()] == ["phase1"]  # nothing moved aside


def test_a_kill_during_a_background_checkpoint_write_resumes_from_the_previous_one(runs, tmp_path):
    """Checkpoints written in the background (``train.async_checkpoint: on``), each held 2 s inside its write: the
    SIGKILL after step 4 lands while checkpoint 4 is written, so the run resumes from 3 — bit-identically."""
    straight = runs[0]
    params = untrained_clone(straight, tmp_path)
    data = yaml.safe_load(params.read_text())
    data["train"]["async_checkpoint"] = "on"
    params.write_text(yaml.safe_dump(data))
    died = train(params, "phase1", env={"SDFORGE_KILL_IN_WRITE_AT_STEP": "4", "SDFORGE_SLOW_CHECKPOINT_S": "2"})
    assert died.returncode == -9 and "checkpoints in the background" in died.stderr, died.stderr[-3000:]
    run_dir = tmp_path / "runs/phase1"
    assert not (run_dir / "checkpoint-00000004").exists()  # its write was in flight (maybe not even begun)
    resumed = train(params, "phase1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 3 (epoch 1, step 0 of it)" in resumed.stderr
    for sub in ("unet", "unet_ema"):
        a, b = weights(straight, "phase1", sub), weights(tmp_path, "phase1", sub)
        assert all(torch.equal(a[k], b[k]) for k in a), f"{sub} differs after the resume"


def test_a_new_text_encoder_retrains_the_finished_phase(runs, tmp_path):
    """Issue 37's defect 2: after a finished phase, changed models (here the frozen text encoder) must retrain it,
    not resume the finished run and re-export its weights."""
    straight = runs[0]
    params = clone_workspace(straight, tmp_path)
    encoder = tmp_path / "models/text_encoder/model.safetensors"
    tensors = load_file(encoder)
    first = sorted(tensors)[0]
    save_file({**tensors, first: tensors[first] + 0.01}, encoder)
    done = train(params, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = json.loads((tmp_path / "metrics/train/phase1.json").read_text())
    assert (metrics["resumed_at_step"], metrics["steps"]) == (0, 6)
    assert not torch.equal(weights(straight, "phase1", "unet")["conv_in.weight"],
                           weights(tmp_path, "phase1", "unet")["conv_in.weight"])  # fmt: skip


def test_next_phase_starts_from_previous_ema(runs):
    straight = runs[0]
    from sdforge.config import load_params
    from sdforge.training.unet_init import load_init_unet

    params = load_params(straight / "params.yaml")
    unet = load_init_unet(straight / "checkpoints/phase1", "ema", params.models.unet.model_dump())
    ema = weights(straight, "phase1", "unet_ema")
    assert all(torch.equal(unet.state_dict()[k], ema[k]) for k in ema)


def test_architecture_mismatch_is_a_clear_error(runs):
    from sdforge.training.unet_init import load_init_unet

    spec = {**TRAIN_UNET, "block_out_channels": [32, 64]}
    with pytest.raises(
        InputError, match=r"block_out_channels=\[16, 32\] but params models.unet.block_out_channels=\[32, 64\]"
    ):
        load_init_unet(runs[0] / "checkpoints/phase1", "ema", spec)


def test_validation_images_are_logged_and_do_not_change_training(runs, fresh_workspace, tmp_path):
    """``train.validation_every`` logs an EMA-sampled grid per due step; the weights equal a run without it."""
    import mlflow

    straight = runs[0]
    params_file = fresh_workspace
    data = yaml.safe_load(params_file.read_text())
    data["train"].update(validation_every=2, validation_prompts=3)
    data["eval"]["steps"] = 2
    params_file.write_text(yaml.safe_dump(data))
    done = train(params_file, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    for sub in ("unet", "unet_ema"):
        a, b = weights(straight, "phase1", sub), weights(tmp_path, "phase1", sub)
        assert all(torch.equal(a[k], b[k]) for k in a), f"{sub} changed by validation sampling"
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("sdforge")
    (run,) = client.search_runs([exp.experiment_id], "tags.`sdforge.stage` = 'train'")
    logged = sorted(a.path for a in client.list_artifacts(run.info.run_id, "validation"))
    assert logged == [f"validation/step-{s:08d}.png" for s in (2, 4, 6)]
    from PIL import Image

    grid = Image.open(client.download_artifacts(run.info.run_id, logged[-1], str(tmp_path)))
    assert grid.size[0] == 3 * 128  # one captioned cell per validation prompt
