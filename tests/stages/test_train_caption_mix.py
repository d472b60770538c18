"""train stage with ``caption_mix``: the realised mix of original and synthetic captions is the planned one within
sampling error, the ledger records each sample's choice, the synthetic ids are what trains, a run crashed after
step 4 resumes to bit-identical weights, and two ranks choose the same captions as one process (the one-process
runs in process: ``stages.train.run``; SIGKILL and resume through the CLI: tests/stages/test_train.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from sdforge.config import load_params
from sdforge.io import write_json
from sdforge.latents.loader import LatentIndexDataset, caption_choice
from stages import train as train_stage
from tests.fixtures.toy_job import CrashAfter
from tests.fixtures.training import (
    DDP_MAX_ABS_DIFF,
    SAMPLES,
    build_workspace,
    clone_workspace,
    edit_params,
    train,
    weights,
)

SHARE = 0.5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("SDFORGE_PROGRESS", "0")
    roots = {name: tmp_path_factory.mktemp(name) for name in ("straight", "killed", "originals", "two_ranks")}
    base = build_workspace(roots["straight"], SHARE).parent
    files = {name: clone_workspace(base, roots[name]) for name in ("killed", "two_ranks", "originals")}
    files["straight"] = base / "params.yaml"
    for phase in ("phase1", "phase2"):  # the same store (synthetic ids too), every sample with its original caption
        edit_params(files["originals"], f"phases.{phase}", caption_mix={"original": 1.0, "synthetic": 0.0})
    data = yaml.safe_load(files["two_ranks"].read_text())
    data["train"]["nproc_per_node"] = 2
    data["phases"]["phase1"]["batch_size"] = 4  # 4 × accumulation 2 × 2 ranks: the same global batch 16
    files["two_ranks"].write_text(yaml.safe_dump(data))
    done = train(files["two_ranks"], "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("straight", "originals"):
        _train_here(files[name])
    with pytest.raises(RuntimeError, match="crashed after step 4"):
        _train_here(files["killed"], [CrashAfter(4)])
    _train_here(files["killed"])
    mp.undo()
    return roots


def _train_here(params_file: Path, hooks=()) -> None:
    """The stage's ``run`` in this process, its metrics written where the CLI writes them."""
    params = load_params(params_file)
    metrics = train_stage.run(params, "phase1", hooks=list(hooks))
    write_json(Path(params.paths.metrics) / "train" / "phase1.json", metrics)


def _metrics(root: Path) -> dict:
    return json.loads((root / "metrics/train/phase1.json").read_text())


def test_the_realised_caption_mix_is_the_planned_one_within_sampling_error(runs):
    m = _metrics(runs["straight"])
    trained = 2 * SAMPLES  # 2 epochs, every sample once per epoch
    assert m["caption.laion.synthetic"] + m["caption.laion.original"] == trained
    assert m["caption.laion.planned_synthetic_share"] == SHARE
    assert abs(m["caption.laion.synthetic_share"] - SHARE) <= 4 * math.sqrt(SHARE * (1 - SHARE) / trained)
    assert 0 < m["caption.laion.synthetic"] < trained


def test_the_ledger_records_the_choice_made_from_seed_sample_and_epoch(runs):
    root = runs["straight"]
    params = load_params(root / "params.yaml")
    data = LatentIndexDataset(
        root / "data/mixes/phase1.parquet", root / "data/latents", params.phase_resolution("phase1")
    )
    ledger = pq.read_table(root / "checkpoints/phase1/ledger.parquet").to_pydict()
    for epoch in (0, 1):
        choice = caption_choice(data, params.train.seed, epoch, SHARE)
        rows = [i for i, e in enumerate(ledger["epoch"]) if e == epoch]
        assert [ledger["synthetic"][i] for i in rows] == choice[[ledger["position"][i] for i in rows]].tolist()
    assert sum(ledger["synthetic"]) == _metrics(root)["caption.laion.synthetic"]


def test_a_crashed_run_with_a_caption_mix_resumes_bit_identical(runs):
    for sub in ("unet", "unet_ema"):
        a, b = weights(runs["straight"], "phase1", sub), weights(runs["killed"], "phase1", sub)
        assert all(torch.equal(a[k], b[k]) for k in a), f"{sub} differs after resume"
    assert _metrics(runs["killed"])["caption.laion.synthetic"] == _metrics(runs["straight"])["caption.laion.synthetic"]


def test_two_ranks_choose_the_same_captions_and_match_one_process(runs):
    one, two = _metrics(runs["straight"]), _metrics(runs["two_ranks"])
    assert {k: v for k, v in one.items() if k.startswith("caption.")} == {
        k: v for k, v in two.items() if k.startswith("caption.")
    }
    for sub in ("unet", "unet_ema"):
        a, b = weights(runs["straight"], "phase1", sub), weights(runs["two_ranks"], "phase1", sub)
        assert max(float((a[k].double() - b[k].double()).abs().max()) for k in a) <= DDP_MAX_ABS_DIFF


def test_the_synthetic_ids_are_what_trains(runs):
    a, b = weights(runs["straight"], "phase1", "unet"), weights(runs["originals"], "phase1", "unet")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) > 1e-6
    assert _metrics(runs["originals"])["caption.laion.synthetic"] == 0
    assert np.isfinite(_metrics(runs["straight"])["final_loss"])
