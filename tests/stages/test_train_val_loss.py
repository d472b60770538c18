"""The validation loss while training: when it is measured, what it reports (step record, loss CSV, MLflow,
the phase's metrics), and that measuring it changes no weight."""

import csv
import json
import sqlite3

import pytest
import yaml

from sdforge.training.reporting import read_steps
from tests.fixtures.training import DDP_MAX_ABS_DIFF, build_workspace, edit_params, train, untrained_clone, weights

HELD_OUT = 16
"""Of the tiny store's 48 samples: the phases train on the other 32 (2 steps of 16 per epoch, 2 epochs)."""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return build_workspace(tmp_path_factory.mktemp("val-loss"), held_out=HELD_OUT)


def test_val_loss_every_n_steps_and_at_the_end_and_it_changes_no_weight(workspace, tmp_path):
    edit_params(workspace, "train", val_loss_every=3)  # steps 3 and 4 (the end) of 4
    done = train(workspace, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    root = workspace.parent
    measured = {s: r for s, r in read_steps(root / "runs" / "phase1").items() if "val_loss" in r}
    assert sorted(measured) == [3, 4]
    last = measured[4]
    levels = [k for k in last if k.startswith("val_loss.t")]
    assert levels == sorted(levels) and len(levels) == 8 and "val_loss.t0.06" in levels
    assert last["val_loss"] == pytest.approx(sum(last[k] for k in levels) / 8, rel=1e-9)
    assert last["val_loss.laion"] == pytest.approx(last["val_loss"], rel=1e-12)  # one source
    metrics = json.loads((root / "metrics" / "train" / "phase1.json").read_text())
    assert metrics["final_val_loss"] == round(last["val_loss"], 6)
    assert (metrics["val_loss_samples"], metrics["val_loss_measurements"]) == (HELD_OUT, 2)
    with (root / "metrics" / "train_loss" / "phase1.csv").open() as f:
        curve = {int(r["step"]): r["val_loss"] for r in csv.DictReader(f)}
    assert [s for s, v in curve.items() if v] == [3, 4] and float(curve[4]) == pytest.approx(last["val_loss"], rel=1e-5)
    with sqlite3.connect(root / "mlflow.db") as db:
        rows = db.execute("select step, value from metrics where key = 'val_loss' order by step").fetchall()
        parent = db.execute("select step from metrics where key = 'train.val_loss' order by step").fetchall()
    assert [s for s, _ in rows] == [3, 4] and rows[1][1] == pytest.approx(last["val_loss"])
    assert [s for (s,) in parent] == [3, 4]

    other = untrained_clone(root, tmp_path / "every-step")
    edit_params(other, "train", val_loss_every=1)
    done = train(other, "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    for sub in ("unet", "unet_ema"):
        ours, theirs = weights(root, "phase1", sub), weights(other.parent, "phase1", sub)
        assert all(ours[k].equal(theirs[k]) for k in ours), f"{sub}: measuring every step changed the weights"
    again = {s: r for s, r in read_steps(other.parent / "runs" / "phase1").items() if "val_loss" in r}
    assert sorted(again) == [1, 2, 3, 4] and again[4]["val_loss"] == last["val_loss"]  # same inputs, same value
    assert again[3]["val_loss"] == measured[3]["val_loss"]


@pytest.mark.ranks  # several training processes at once: `make test-ranks` (CI runs it after `make test`)
def test_two_ranks_measure_on_the_main_rank_and_agree_with_one(workspace, tmp_path):
    """DDP: rank 0 measures while rank 1 waits in the next step (no hang); the values match one process's."""
    one = untrained_clone(workspace.parent, tmp_path / "one")
    edit_params(one, "train", val_loss_every=2)
    two = untrained_clone(workspace.parent, tmp_path / "two")
    data = yaml.safe_load(two.read_text())
    data["train"].update(nproc_per_node=2, val_loss_every=2)
    data["phases"]["phase1"]["batch_size"] = 4  # 4 × accumulation 2 × 2 ranks: the same global batch 16
    two.write_text(yaml.safe_dump(data))
    for params in (one, two):
        done = train(params, "phase1")
        assert done.returncode == 0, done.stderr[-3000:]
    curves = [{s: r["val_loss"] for s, r in read_steps(p.parent / "runs" / "phase1").items() if "val_loss" in r}
              for p in (one, two)]  # fmt: skip
    assert sorted(curves[0]) == sorted(curves[1]) == [2, 4]
    for step in (2, 4):  # the EMA weights agree to DDP_MAX_ABS_DIFF, so does a mean of squared errors
        assert curves[1][step] == pytest.approx(curves[0][step], abs=DDP_MAX_ABS_DIFF)
