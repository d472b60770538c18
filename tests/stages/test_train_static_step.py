"""``train.cuda_graphs: step`` through the train stage on a CPU (the static-buffer step without capture): the phase
trains bit for bit as the eager step does (docs/SPEED.md). A run resumed across the switch, which is the job's shape:
tests/stages/test_train_inputs.py."""

from __future__ import annotations

import json

import torch

from tests.fixtures.training import edit_params, train, weights


def _identical(root, straight) -> None:
    for sub in ("unet", "unet_ema"):
        a, b = weights(root, "phase1", sub), weights(straight, "phase1", sub)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), sub


def test_the_static_step_trains_the_phase_bit_for_bit(fresh_workspace, straight_phase1):
    params = fresh_workspace
    edit_params(params, "train", cuda_graphs="step")
    done = train(params, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "static buffers, no capture (CPU)" in done.stderr
    metrics = json.loads((params.parent / "metrics/train/phase1.json").read_text())
    straight = json.loads((straight_phase1 / "metrics/train/phase1.json").read_text())
    assert metrics["steps"] == straight["steps"] == 6 and metrics["final_loss"] == straight["final_loss"]
    _identical(params.parent, straight_phase1)
