"""Write faults name their cause (docs/RESILIENCE.md, Write faults): a full disk, a quota, a file-size limit, a
read-only or forbidden folder is one line naming the path, the cause and what to do — from the atomic writes, the
metrics JSON of every stage CLI, the MLflow spool and the shard writer — and what was there before is intact."""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
from pathlib import Path

import pytest
from PIL import Image

from sdforge import io as sdio
from sdforge.config import FetchSettings, Tracking
from sdforge.ingest import reshard
from sdforge.ingest.sources.rows import row, write_rows
from sdforge.io import atomic_write_bytes, run_stage_command, write_json
from sdforge.tracking import stage_run
from sdforge.tracking_spool import pending, spool_dir
from tests.fixtures.write_faults import fsync_fails, read_only, tmpfs

REPO = Path(__file__).resolve().parents[2]
WRITE_FAULT = r"cannot write.*: {cause} \({name}\); .*, then re-run"


def _fault(cause: str, name: str) -> str:
    return WRITE_FAULT.format(cause=cause, name=name)


@pytest.mark.parametrize(
    ("code", "cause", "hint"),
    [
        (errno.ENOSPC, "no space left on device", "free space on /"),
        (errno.EDQUOT, "disk quota exceeded", "quota"),
        (errno.EFBIG, "file too large", "larger files"),
        (errno.EROFS, "read-only file system", "mounted read-only"),
        (errno.EACCES, "permission denied", f"let user {os.geteuid()} write to"),
    ],
)
def test_each_fault_of_an_atomic_write_is_one_line_and_the_previous_file_is_intact(
    tmp_path, monkeypatch, code, cause, hint
):
    target = tmp_path / "out" / "table.parquet"
    atomic_write_bytes(target, b"the previous version")
    fsync_fails(monkeypatch, 1, code)
    with pytest.raises(ValueError, match=_fault(cause, errno.errorcode[code])) as caught:
        atomic_write_bytes(target, b"x" * 100)
    message = str(caught.value)
    assert message.startswith(f"{target}: ") and "\n" not in message and hint in message
    assert target.read_bytes() == b"the previous version"
    assert sorted(p.name for p in target.parent.iterdir()) == ["table.parquet"]  # no temp file left


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors
        OSError("No space left on device (os error 28): /x/filtered.parquet"),  # polars, errno None
        OSError(28, "Error writing bytes to file. Detail: [errno 28] No space left on device"),  # pyarrow
        RuntimeError("(sqlite3.OperationalError) database or disk is full"),  # MLflow's SQLite store
    ],
)
def test_a_fault_carried_only_in_the_message_is_named(tmp_path, error):
    with pytest.raises(ValueError, match=_fault("no space left on device", "ENOSPC")):
        with sdio.naming_write_faults(tmp_path / "f.bin", "the file"):
            raise error


def test_torch_zip_writer_failure_without_errno_is_judged_from_the_file_system(tmp_path, monkeypatch):
    """By path, torch reports EFBIG / ENOSPC only as an iostream error: the file-size limit in force names it."""
    limit = 10 * 2**20
    monkeypatch.setattr(resource, "getrlimit", lambda which: (limit, limit))
    with pytest.raises(ValueError, match=r"file too large \(EFBIG, found on the file system") as caught:
        with sdio.naming_write_faults(tmp_path / "state.pt", "a checkpoint file"):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert "`ulimit -f`; 10.0 MiB now" in str(caught.value)


@pytest.mark.parametrize(
    "error", [RuntimeError("a bug"), OSError(errno.ENOENT, "No such file or directory"), KeyError("x")]
)
def test_other_errors_pass_unchanged(tmp_path, error):
    with pytest.raises(type(error)) as caught:
        with sdio.naming_write_faults(tmp_path / "f.bin"):
            raise error
    assert caught.value is error


def test_a_full_disk_is_named_and_the_previous_file_kept(tmp_path):
    """A real ENOSPC from the kernel (a 1 MiB tmpfs): the temp file goes, so the space is free again."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        target = disk / "latents.safetensors"
        atomic_write_bytes(target, b"previous")
        with pytest.raises(ValueError, match=_fault("no space left on device", "ENOSPC")) as caught:
            atomic_write_bytes(target, os.urandom(2 * 2**20))
        assert str(caught.value).startswith(f"{target}: ") and f"free space on {disk}" in str(caught.value)
        assert target.read_bytes() == b"previous" and [p.name for p in disk.iterdir()] == [target.name]


def _stage_cli(params: Path, stage: str = "write_fault_probe") -> None:
    run_stage_command(stage, lambda p, item: {"rows": 3}, params, None, needs_item=False)


def test_the_metrics_json_of_a_stage_on_a_full_disk_is_one_line_with_status_2(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)  # params.yaml's paths are relative: metrics/ lands here
    _stage_cli(REPO / "params.yaml")
    metrics = tmp_path / "metrics" / "write_fault_probe.json"
    assert json.loads(metrics.read_text()) == {"rows": 3}
    fsync_fails(monkeypatch, 1)
    caplog.clear()
    with pytest.raises(SystemExit) as stop, caplog.at_level(logging.ERROR):
        _stage_cli(REPO / "params.yaml")
    assert stop.value.code == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith(f"{Path('metrics/write_fault_probe.json')}: cannot write: no space left on device (ENOSPC)")
    assert json.loads(metrics.read_text()) == {"rows": 3}  # the previous metrics are intact


def test_a_disk_fault_no_writer_named_still_ends_a_stage_in_one_line(tmp_path, monkeypatch, caplog):
    """The stage CLI's net: a writer without its own wrapper (here a bare ``write_text``) on a read-only disk."""
    monkeypatch.chdir(tmp_path)

    def run(params, item):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "probe.json"))

    with pytest.raises(SystemExit) as stop, caplog.at_level(logging.ERROR):
        run_stage_command("eval_grid", run, REPO / "params.yaml", None, needs_item=False)
    assert stop.value.code == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith(f"{tmp_path / 'probe.json'}: cannot write: read-only file system (EROFS)")


# -- the MLflow spool ----------------------------------------------------------------------------
def _spooling(tmp_path: Path) -> Tracking:
    return Tracking(mlflow_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="write-faults", spool=True)


def test_a_spool_write_on_a_full_disk_is_named_and_leaves_no_half_entry(tmp_path, monkeypatch):
    cfg = _spooling(tmp_path)
    real = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == "entry.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    spool = spool_dir(cfg.mlflow_uri)
    with pytest.raises(ValueError, match=_fault("no space left on device", "ENOSPC")) as caught:
        with stage_run(cfg, "data", "mix_phase", {"a": 1}, deferrable=True) as mlflow:
            mlflow.log_metrics({"samples": 3})
    assert str(caught.value).startswith(f"{spool}: cannot write the spooled MLflow run")
    assert "the stage's outputs are written" in str(caught.value)
    assert pending(spool) == []  # the half-written .tmp entry is never replayed


def test_a_stage_that_failed_keeps_its_own_error_when_the_spool_cannot_be_written(tmp_path, monkeypatch, caplog):
    cfg = _spooling(tmp_path)

    def read_only_mkdir(self, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", read_only_mkdir)
    with pytest.raises(RuntimeError, match="the stage's own error"), caplog.at_level(logging.ERROR):
        with stage_run(cfg, "data", "mix_phase", deferrable=True):
            raise RuntimeError("the stage's own error")
    assert any("read-only file system (EROFS)" in r.getMessage() for r in caplog.records)


# -- shards --------------------------------------------------------------------------------------
def _loose_source(meta: Path, count: int = 8) -> Path:
    meta.mkdir(parents=True)
    rows = []
    for i in range(count):
        Image.new("RGB", (40, 40), (30 * i, 0, 0)).save(meta / f"{i}.png")
        rows.append(row(None, f"{i}.png", f"image {i}", {"i": i}))
    write_rows(rows, meta.parent / "filtered.parquet")
    return meta.parent / "filtered.parquet"


def test_a_shard_write_on_a_full_disk_is_named_complete_shards_are_kept_and_a_rerun_finishes(
    tmp_path, monkeypatch, tree_digest
):
    filtered = _loose_source(tmp_path / "meta")
    fetch = FetchSettings(image_size=32, shard_size=4, processes=1)
    clean, out = tmp_path / "clean", tmp_path / "out"
    reshard.run(filtered, tmp_path / "meta", clean, fetch, "local")
    calls = fsync_fails(monkeypatch, 4)  # shard 0: tar, parquet, stats; shard 1's tar fails
    with pytest.raises(ValueError, match=_fault("no space left on device", "ENOSPC")) as caught:
        reshard.run(filtered, tmp_path / "meta", out, fetch, "local")
    assert str(caught.value).startswith(f"{out / '00001.tar'}: ") and len(calls) == 4
    assert sorted(p.name for p in out.glob("0000*")) == ["00000.parquet", "00000.tar", "00000_stats.json"]
    first = {p.name: p.stat().st_ino for p in out.glob("00000*")}
    monkeypatch.undo()
    reshard.run(filtered, tmp_path / "meta", out, fetch, "local")
    assert {p.name: p.stat().st_ino for p in out.glob("00000*")} == first  # kept, not rewritten
    assert tree_digest(out) == tree_digest(clean)


def test_a_read_only_folder_is_named_before_anything_is_written(tmp_path):
    """A real EROFS (a read-only tmpfs) for a writer that creates its folder: the atomic write names it."""
    with tmpfs(tmp_path / "disk", "1m") as disk:
        (disk / "metrics").mkdir()
        read_only(disk)
        with pytest.raises(ValueError, match=_fault("read-only file system", "EROFS")) as caught:
            write_json(disk / "metrics" / "train" / "phase1.json", {"a": 1})
        assert f"{disk} is mounted read-only" in str(caught.value)


def test_a_stage_output_folder_is_replaced_or_its_read_only_disk_named_with_nothing_removed(tmp_path):
    """``fresh_folder``: the stage's own folder emptied and re-created; on a read-only disk one line, its files
    untouched (``rmtree(ignore_errors=True)`` used to fail silently there, then ``mkdir`` said "File exists")."""
    out = tmp_path / "filtered" / "laion"
    (out / "old").mkdir(parents=True)
    (out / "old" / "part.parquet").write_bytes(b"x")
    assert sdio.fresh_folder(out) == out and out.is_dir() and not any(out.iterdir())
    with tmpfs(tmp_path / "disk", "1m") as disk:
        (disk / "laion").mkdir()
        (disk / "laion" / "filtered.parquet").write_bytes(b"mine")
        read_only(disk)
        with pytest.raises(sdio.OutputError, match=_fault("read-only file system", "EROFS")):
            sdio.fresh_folder(disk / "laion", "the filtered metadata", setting="paths.filtered")
        assert (disk / "laion" / "filtered.parquet").read_bytes() == b"mine"
