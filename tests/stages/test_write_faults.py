"""Write faults through the stages (docs/RESILIENCE.md, Write faults): a real file-size limit (EFBIG from the kernel)
during a background checkpoint of the train stage's CLI, a read-only output folder in encode_latents and in
filter_metadata, a disk that fills up while latents or the filtered parquet are written. Each is one line naming
the path and the cause; what was written before stays; a rerun with the fault gone resumes and finishes."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import polars as pl
import pytest

from model.builders import build_tiny_vae
from sdforge.config import Encode, FilterRules, Source
from sdforge.demo.models import write_demo_tokenizer
from sdforge.ingest.shards import tar_bytes
from sdforge.training.checkpoints import checkpoint_dirs, verify_checkpoint
from stages import encode_latents, filter_metadata
from tests.fixtures.demo_data import tree_digest
from tests.fixtures.training import REPO, edit_params, train
from tests.fixtures.write_faults import file_size_limit, fsync_fails, read_only, tmpfs

RES = 16
READ_ONLY = r"cannot write {what}: read-only file system \(EROFS\); .* is mounted read-only"
FULL_DISK = r"cannot write: no space left on device \(ENOSPC\)"


# -- checkpoints: a real EFBIG through the train stage's CLI ------------------------------------------------
def _train_limited(params: Path, max_bytes: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "SDFORGE_PROGRESS": "0", "PYTHONPATH": str(REPO)}
    env.pop("SDFORGE_KILL_AT_STEP", None)
    return subprocess.run(
        [sys.executable, "-m", "stages.train", "--params", str(params), "--item", "phase1"],
        cwd=params.parent, env=env, capture_output=True, text=True, timeout=300, preexec_fn=file_size_limit(max_bytes),
    )  # fmt: skip


def test_a_file_size_limit_in_a_background_checkpoint_is_one_line_and_the_rerun_resumes(fresh_workspace):
    params, root = fresh_workspace, fresh_workspace.parent
    edit_params(params, "train", async_checkpoint="on")  # the fault happens on the writer thread
    edit_params(params, "tracking", enabled=False)  # no MLflow store growing past the limit
    died = train(params, "phase1", kill_at=3)
    assert died.returncode == -9, died.stderr[-2000:]
    (previous,) = checkpoint_dirs(root / "runs/phase1")
    files = {p.name: p.stat().st_size for p in previous.rglob("*") if p.is_file()}
    state, other = files.pop("state.pt"), max(files.values())
    assert other < state, files
    digest = tree_digest(previous)

    limited = _train_limited(params, (other + state) // 2)  # the weights fit; the optimizer state does not

    assert limited.returncode == 2, limited.stderr[-3000:]
    assert "Traceback" not in limited.stderr
    last = limited.stderr.strip().splitlines()[-1]
    assert re.search(
        r"ERROR sdforge\.io: \S+/runs/phase1/checkpoint-\d{8}\.tmp/state\.pt: cannot write a checkpoint file: "
        r"file too large \(EFBIG\); raise the file-size limit \(`ulimit -f`; .* now\) or point paths\.runs "
        r"elsewhere, then re-run; the previous checkpoint \(if any\) is intact: a rerun resumes from it$",
        last,
    ), last
    assert checkpoint_dirs(root / "runs/phase1") == [previous] and tree_digest(previous) == digest
    verify_checkpoint(previous)

    resumed = train(params, "phase1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    metrics = json.loads((root / "metrics/train/phase1.json").read_text())
    assert metrics["resumed_at_step"] == int(previous.name.removeprefix("checkpoint-")) and metrics["steps"] == 6
    assert (metrics["ledger.duplicates"], metrics["ledger.missing"], metrics["ledger.unplanned"]) == (0, 0, 0)


# -- latents -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def encode_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny VAE and tokenizer, and two input tars of 4 samples each: ``(models, shards)``."""
    root = tmp_path_factory.mktemp("encode-inputs")
    vae = build_tiny_vae([8, 16], 1, 4, seed=0)
    vae.save_pretrained(root / "models" / "vae", safe_serialization=True)
    write_demo_tokenizer(["a", "red", "square"], root / "models" / "tokenizer", 77)
    rng = np.random.default_rng(0)
    (root / "shards").mkdir()
    for t in range(2):
        samples = []
        for i in range(4):
            ok, jpg = cv2.imencode(".jpg", rng.integers(0, 256, (RES, RES, 3), dtype=np.uint8))
            samples.append({"__key__": f"{t:05d}{i:04d}", "jpg": jpg.tobytes(), "txt": "a red square", "json": "{}"})
        (root / "shards" / f"{t:05d}.tar").write_bytes(tar_bytes(samples))
    return root / "models", root / "shards"


def _encode(inputs: tuple[Path, Path], out: Path) -> dict:
    models, shards = inputs
    cfg = Encode(batch_size=4, device="cpu", resolution=RES, decode_workers=1, mixed_precision="no")
    return encode_latents.run(cfg, "laion", shards, models, out)


def test_a_read_only_latents_folder_is_one_line_before_any_encoding(encode_inputs, tmp_path):
    with tmpfs(tmp_path / "disk") as disk:
        read_only(disk)
        out = disk / "latents" / "laion" / "256"
        with pytest.raises(ValueError, match=READ_ONLY.format(what="latents")) as caught:
            _encode(encode_inputs, out)
        assert str(caught.value).startswith(f"{out}: ") and "point paths.latents elsewhere" in str(caught.value)


def test_a_disk_that_fills_while_latents_are_written_is_named_and_the_rerun_keeps_the_written_shard(
    encode_inputs, tmp_path, monkeypatch
):
    clean = tmp_path / "clean"
    _encode(encode_inputs, clean)
    out = tmp_path / "out"
    fsync_fails(monkeypatch, 3)  # shard 0's safetensors and manifest part go through; shard 1's safetensors fails
    with pytest.raises(ValueError, match=FULL_DISK) as caught:
        _encode(encode_inputs, out)
    assert str(caught.value).startswith(f"{out / 'shard-00001-16x16.safetensors'}: ")
    monkeypatch.undo()
    again = _encode(encode_inputs, out)
    assert (again["shards_reused"], again["shards_encoded"]) == (1, 1)
    assert tree_digest(out) == tree_digest(clean)


# -- filtered metadata ---------------------------------------------------------------------------------------
LAION = Source(kind="laion", repo="unused", filter=FilterRules(min_width=0, min_height=0))


def _metadata(root: Path) -> Path:
    meta = root / "meta"
    meta.mkdir()
    rows = [{"URL": f"http://example.com/{i}.jpg", "TEXT": f"c {i}", "WIDTH": 64, "HEIGHT": 64, "hash": i}
            for i in range(5)]  # fmt: skip
    pl.DataFrame(rows).write_parquet(meta / "part-0.parquet")
    return meta


def test_a_read_only_filtered_folder_is_named_not_a_file_exists_error(tmp_path):
    """The trial's case: ``rmtree(ignore_errors=True)`` failed silently, then ``mkdir`` said "exists"."""
    meta = _metadata(tmp_path)
    with tmpfs(tmp_path / "disk") as disk:
        out = disk / "filtered" / "laion"
        filter_metadata.run(LAION, "laion", meta, out)
        before = tree_digest(out)
        read_only(disk)
        with pytest.raises(ValueError, match=READ_ONLY.format(what="the filtered metadata")) as caught:
            filter_metadata.run(LAION, "laion", meta, out)
        assert str(caught.value).startswith(f"{out}: ") and "point paths.filtered elsewhere" in str(caught.value)
        assert tree_digest(out) == before  # the previous output is as it was


def test_a_folder_that_refuses_writes_is_named_before_it_is_cleared(tmp_path, monkeypatch):
    """The same without a mount: every create, unlink and rmdir fails with EROFS, as in a read-only folder."""
    meta = _metadata(tmp_path)
    out = tmp_path / "filtered"
    filter_metadata.run(LAION, "laion", meta, out)
    real_open = os.open

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    def open_read_only(path, flags, *args, **kwargs):
        return refuse() if flags & os.O_CREAT else real_open(path, flags, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(os, "open", open_read_only)
        patch.setattr(os, "unlink", refuse)
        patch.setattr(os, "rmdir", refuse)
        with pytest.raises(ValueError, match=r"cannot write the filtered metadata: read-only file system \(EROFS\)"):
            filter_metadata.run(LAION, "laion", meta, out)
    assert pl.read_parquet(out / "filtered.parquet").height == 5


def test_a_full_disk_while_the_filtered_parquet_is_written_is_named(tmp_path, monkeypatch):
    meta = _metadata(tmp_path)

    def full(self, *args, **kwargs):
        raise pl.exceptions.ComputeError(
            "parquet: File out of specification: underlying IO error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(pl.LazyFrame, "sink_parquet", full)
    out = tmp_path / "filtered"
    full_disk = r"cannot write the filtered metadata: no space left on device \(ENOSPC\)"
    with pytest.raises(ValueError, match=full_disk) as caught:
        filter_metadata.run(LAION, "laion", meta, out)
    assert str(caught.value).startswith(f"{out / 'filtered.parquet'}: ")
