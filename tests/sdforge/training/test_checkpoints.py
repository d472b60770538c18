"""Checkpoints: atomic, verified by their manifest, pruned by retention, corrupt ones skipped with a fallback."""

from __future__ import annotations

import json
import logging
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from sdforge.training.checkpoints import (
    CheckpointError,
    Retention,
    capture_rng,
    checkpoint_dirs,
    load_state,
    newest_loadable,
    restore_rng,
    retained,
)
from sdforge.training.resume import resume_point
from tests.fixtures.checkpoints import CPU, rank_rng, save


def names(run_dir: Path) -> list[str]:
    return [p.name for p in checkpoint_dirs(run_dir)]


LOSSES = {1: 0.5, 2: 0.4, 3: 0.6, 4: 0.7, 5: 0.8, 6: 0.9}


@pytest.mark.parametrize(
    ("losses", "rule", "kept"),
    [
        (LOSSES, Retention(keep_last=2), {5, 6}),
        (LOSSES, Retention(keep_last=2, keep_every=2), {2, 4, 5, 6}),
        (LOSSES, Retention(keep_last=2, keep_best=True), {2, 5, 6}),
        (LOSSES, Retention(keep_last=1, keep_every=4, keep_best=True), {2, 4, 6}),
        (LOSSES, Retention(keep_last=10, keep_every=3, keep_best=True), set(LOSSES)),
        # ties go to the earliest step; no loss / NaN is never "best"
        ({1: 0.3, 2: 0.3, 3: None, 4: math.nan, 5: 0.9, 6: 0.95}, Retention(1, 3, True), {1, 3, 6}),
        ({3: None, 4: None}, Retention(1, 0, True), {4}),
        ({}, Retention(2, 2, True), set()),
    ],
)
def test_retained_exact_sets(losses, rule, kept):
    assert retained(losses, rule) == kept


def test_save_prunes_by_retention_and_marks_complete(tmp_path):
    rule = Retention(keep_last=2, keep_every=3, keep_best=True)
    for step, loss in LOSSES.items():
        save(tmp_path, step, loss, rule=rule)
    assert names(tmp_path) == [
        "checkpoint-00000002",
        "checkpoint-00000003",
        "checkpoint-00000005",
        "checkpoint-00000006",
    ]
    state = load_state(tmp_path / "checkpoint-00000006")
    assert state["progress"] == {"step": 6, "epoch": 0, "batch": 6} and state["v"].item() == 6
    assert state["loss"] == 0.9
    assert not list(tmp_path.glob("*.tmp"))


def test_layout_manifest_and_per_rankrank_rng(tmp_path):
    ckpt = save(tmp_path, 7, loss=0.25, world=2)
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert files == [
        "COMPLETE",
        "config.json",
        "rng-rank0.pt",
        "rng-rank1.pt",
        "state.pt",
        "unet/config.json",
        "unet/diffusion_pytorch_model.safetensors",
    ]
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    assert {k: manifest[k] for k in ("step", "epoch", "batch", "loss", "world")} == {
        "step": 7,
        "epoch": 0,
        "batch": 7,
        "loss": 0.25,
        "world": 2,
    }
    assert set(manifest["files"]) == set(files) - {"COMPLETE"}
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in manifest["files"].values())
    assert json.loads((ckpt / "config.json").read_text()) == {"train": {"seed": 0}}
    r0, r1 = load_state(ckpt, rank=0, world=2), load_state(ckpt, rank=1, world=2)
    assert torch.equal(r0["rng"]["generator"], rank_rng(0)["generator"])
    assert torch.equal(r1["rng"]["generator"], rank_rng(1)["generator"])
    # another world size (elastic resume): every rank continues rank 0's shared generator, told the old world
    for rank in range(3):
        other = load_state(ckpt, rank=rank, world=3)
        assert other["world"] == 2 and torch.equal(other["rng"]["generator"], rank_rng(0)["generator"])
    (ckpt / "rng-rank1.pt").unlink()
    with pytest.raises(CheckpointError, match="rng-rank1.pt"):
        load_state(ckpt, rank=1, world=2, verify=False)


def test_rng_roundtrip_python_numpy_torch_generator(tmp_path):
    gen = torch.Generator().manual_seed(5)
    torch.save(capture_rng(gen, CPU), tmp_path / "rng.pt")
    first = (random.random(), np.random.rand(), np.random.randn(), torch.rand(2), torch.rand(2, generator=gen))
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True), gen, CPU)
    again = (random.random(), np.random.rand(), np.random.randn(), torch.rand(2), torch.rand(2, generator=gen))
    assert first[:3] == again[:3]
    assert torch.equal(first[3], again[3]) and torch.equal(first[4], again[4])


def test_interrupted_write_is_ignored(tmp_path):
    save(tmp_path, 1)
    (tmp_path / "checkpoint-00000002.tmp").mkdir()
    (tmp_path / "checkpoint-00000003").mkdir()
    (tmp_path / "checkpoint-00000004.download").mkdir()
    assert names(tmp_path) == ["checkpoint-00000001"]


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated state.pt": (lambda c: _truncate(c / "state.pt"), "state.pt has"),
    "corrupt state.pt": (lambda c: _flip_byte(c / "state.pt"), "state.pt does not match its sha256"),
    "truncated safetensors": (
        lambda c: _truncate(c / "unet/diffusion_pytorch_model.safetensors"),
        "diffusion_pytorch_model.safetensors has",
    ),
    "tampered safetensors": (
        lambda c: _flip_byte(c / "unet/diffusion_pytorch_model.safetensors"),
        "diffusion_pytorch_model.safetensors does not match",
    ),
    "missing rank file": (lambda c: (c / "rng-rank1.pt").unlink(), "rng-rank1.pt is missing"),
    "tampered rank file": (lambda c: _flip_byte(c / "rng-rank0.pt"), "rng-rank0.pt does not match"),
    "garbage manifest": (lambda c: (c / "COMPLETE").write_text("2\n"), "not a format-3 manifest"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_newest_falls_back_with_warning(tmp_path, caplog, damage):
    save(tmp_path, 1, world=2)
    newest = save(tmp_path, 2, world=2)
    spoil, reason = DAMAGE[damage]
    spoil(newest)
    with caplog.at_level(logging.WARNING):
        ckpt, state = newest_loadable(tmp_path, lambda c: load_state(c, rank=1, world=2))
    assert ckpt.name == "checkpoint-00000001" and state["v"].item() == 1
    assert "checkpoint-00000002 is unreadable" in caplog.text and reason in caplog.text
    with caplog.at_level(logging.WARNING):
        ckpt, state = resume_point(tmp_path, rank=0, world=2)
    assert ckpt.name == "checkpoint-00000001"


def test_resume_point_none_when_all_bad(tmp_path, caplog):
    assert resume_point(tmp_path) is None
    _truncate(save(tmp_path, 1) / "state.pt")
    with caplog.at_level(logging.WARNING):
        assert resume_point(tmp_path) is None
    assert "checkpoint-00000001 is unreadable" in caplog.text
