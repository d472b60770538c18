"""Resumable fetch: fingerprint, clean-up of a killed fetch, idempotent canonicalisation, SIGKILL mid-fetch."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import cv2
import numpy as np
import polars as pl
import pyarrow as pa
import pytest
import webdataset as wds

from sdforge.config import FetchSettings, Source
from sdforge.demo.http_server import serve_directory
from sdforge.ingest import fetch_state, shards, url_fetch
from stages import fetch_images

REPO = Path(__file__).resolve().parents[2]

DRIVER = """\
import json, sys
from stages import fetch_images
from sdforge.config import FetchSettings, Source

if __name__ == "__main__":  # img2dataset spawns its workers
    fetch = FetchSettings.model_validate_json(sys.argv[1])
    metrics = fetch_images.run(Source(kind="laion", repo="unused", fetch=fetch), "k", sys.argv[2], ".", sys.argv[3])
    print(json.dumps(metrics))
"""


def _shard_files(folder: Path, shard: str, stats: str | None = '{"count": 2, "successes": 2}') -> None:
    (folder / f"{shard}.tar").write_bytes(b"tar")
    (folder / f"{shard}.parquet").write_bytes(b"parquet")
    if stats is not None:
        (folder / f"{shard}_stats.json").write_text(stats)


def test_discard_unfinished_keeps_finished_shards_only(tmp_path):
    _shard_files(tmp_path, "00000")
    _shard_files(tmp_path, "00001", stats=None)  # in flight when killed: truncated tar + parquet
    _shard_files(tmp_path, "00002", stats='{"count": 2, "succ')  # killed while writing its stats
    _shard_files(tmp_path, "00003")
    (tmp_path / "00003.parquet").unlink()  # stats but no parquet: not finished
    (tmp_path / "00004.tar").write_bytes(b"tar")  # tar only
    _shard_files(tmp_path, "00005")
    (tmp_path / "_tmp").mkdir()
    (tmp_path / "_tmp" / "6.feather").write_bytes(b"arrow")
    (tmp_path / ".00005.tar.abc123.tmp").write_bytes(b"half")  # atomic_write_bytes temporary
    (tmp_path / "notes.json").write_text("{}")  # img2dataset would parse its number
    (tmp_path / fetch_state.FINGERPRINT_FILE).write_text("fp")
    removed = shards.discard_unfinished(tmp_path, keep={fetch_state.FINGERPRINT_FILE})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        fetch_state.FINGERPRINT_FILE,
        "00000.parquet",
        "00000.tar",
        "00000_stats.json",
        "00005.parquet",
        "00005.tar",
        "00005_stats.json",
    ]
    assert len(removed) == 11
    assert shards.finished_shards(tmp_path) == [0, 5]


def test_canonicalize_folder_is_idempotent_and_leaves_canonical_files_untouched(tmp_path):
    with wds.TarWriter(str(tmp_path / "00000.tar")) as writer:
        for key in ("002", "000", "001"):
            writer.write({"__key__": key, "jpg": key.encode(), "txt": key, "json": "{}"})
    shards.write_parquet_table(tmp_path / "00000.parquet", pa.table({"key": ["002", "000", "001"], "x": [2, 0, 1]}))
    (tmp_path / "00000_stats.json").write_text(json.dumps({"count": 3, "start_time": 5.0, "duration": 1.0}))
    shards.canonicalize_folder(tmp_path)
    first = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()}
    assert json.loads(first["00000_stats.json"][0]) == {"count": 3}
    assert list(shards.read_tar(tmp_path / "00000.tar")) == ["000", "001", "002"]
    time.sleep(0.01)
    shards.canonicalize_folder(tmp_path)
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in tmp_path.iterdir()} == first


def test_a_shard_canonicalised_in_its_worker_only_gets_its_stats_rewritten(tmp_path):
    with wds.TarWriter(str(tmp_path / "00003.tar")) as writer:
        for key in ("b", "a"):
            writer.write({"__key__": key, "jpg": key.encode()})
    shards.write_parquet_table(tmp_path / "00003.parquet", pa.table({"key": ["b", "a"]}))
    (tmp_path / "00003_stats.json").write_text(json.dumps({"count": 2, "start_time": 5.0}))
    shards.canonicalize_shard(tmp_path, 3, final=False)  # what the fetch worker does
    stats = json.loads((tmp_path / "00003_stats.json").read_text())
    assert stats == {"count": 2, "start_time": 5.0, shards.FILES_CANONICAL: True}  # img2dataset's logger reads it
    tar = (tmp_path / "00003.tar").read_bytes(), (tmp_path / "00003.tar").stat().st_mtime_ns
    assert list(shards.read_tar(tmp_path / "00003.tar")) == ["a", "b"]
    shards.canonicalize_folder(tmp_path)
    assert json.loads((tmp_path / "00003_stats.json").read_text()) == {"count": 2}
    assert ((tmp_path / "00003.tar").read_bytes(), (tmp_path / "00003.tar").stat().st_mtime_ns) == tar


def test_fingerprint_follows_the_inputs_and_the_output_settings_only(tmp_path):
    filtered = tmp_path / "filtered.parquet"
    pl.DataFrame({"url": ["http://a/1.jpg"], "caption": ["x"]}).write_parquet(filtered)
    base = FetchSettings(image_size=32)
    fp = fetch_state.fingerprint(filtered, base)
    assert fetch_state.fingerprint(filtered, base.model_copy(update={"threads": 3, "processes": 4})) == fp
    assert fetch_state.fingerprint(filtered, base.model_copy(update={"timeout": 1, "retries": 2})) == fp
    for update in ({"image_size": 64}, {"shard_size": 7}, {"allow_networks": ["10.0.0.0/8"]}, {"max_image_pixels": 9}):
        assert fetch_state.fingerprint(filtered, base.model_copy(update=update)) != fp, update
    served = tmp_path / "www"
    (served / "images").mkdir(parents=True)
    (served / "images" / "1.jpg").write_bytes(b"red circle")
    before = fetch_state.served_digest(served)
    (served / "images" / "1.jpg").write_bytes(b"big circle")  # same URL, same size, other image
    assert fetch_state.served_digest(served) != before
    after = fetch_state.fingerprint(filtered, base, served=fetch_state.served_digest(served))
    assert fetch_state.fingerprint(filtered, base, served=before) not in (fp, after)
    out = tmp_path / "out"
    assert fetch_state.prepare_out_dir(out, fp) is False
    _shard_files(out, "00000")
    _shard_files(out, "00001", stats=None)
    assert fetch_state.prepare_out_dir(out, fp) is True  # same fingerprint: finished shard kept
    assert sorted(p.name for p in out.iterdir()) == [
        fetch_state.FINGERPRINT_FILE,
        "00000.parquet",
        "00000.tar",
        "00000_stats.json",
    ]
    pl.DataFrame({"url": ["http://a/2.jpg"], "caption": ["x"]}).write_parquet(filtered)
    other = fetch_state.fingerprint(filtered, base)
    assert other != fp
    assert fetch_state.prepare_out_dir(out, other) is False  # other input: emptied
    assert [p.name for p in out.iterdir()] == [fetch_state.FINGERPRINT_FILE]
    assert (out / fetch_state.FINGERPRINT_FILE).read_text() == other


def _sample_set(folder: Path) -> set[tuple[str, str, str]]:
    return {
        (key, sample["txt"].decode(), hashlib.sha256(sample["jpg"]).hexdigest())
        for key, sample in shards.iter_samples(folder)
    }


def _wait_gone(pgid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"process group {pgid} still alive after SIGKILL")


def test_sigkill_mid_fetch_then_rerun_fetches_only_unfinished_shards(tmp_path, tree_digest):
    n, shard_size = 40, 10
    www = tmp_path / "www"
    www.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        cv2.imwrite(str(www / f"{i:03d}.jpg"), rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))
    (tmp_path / "driver.py").write_text(DRIVER)
    hits: collections.Counter[str] = collections.Counter()
    with serve_directory(www, 0, hits=hits, delay=0.1) as base:
        filtered = tmp_path / "filtered"
        filtered.mkdir()
        paths = [f"/{i:03d}.jpg" for i in range(n)]
        captions = [f"image {i}" for i in range(n)]
        pl.DataFrame({"url": [base + p for p in paths], "caption": captions}).write_parquet(
            filtered / "filtered.parquet"
        )
        slow = FetchSettings(
            image_size=16, processes=1, threads=2, shard_size=shard_size, allow_networks=["127.0.0.0/8"]
        )
        out = tmp_path / "out"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        args = [sys.executable, "driver.py", slow.model_dump_json(), str(filtered), str(out)]
        proc = subprocess.Popen(
            args, cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            deadline = time.monotonic() + 90
            while len(list(out.glob("*_stats.json"))) < 2:
                assert proc.poll() is None, "the fetch ended before it could be killed"
                assert time.monotonic() < deadline, "no two shards finished in time"
                time.sleep(0.02)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        _wait_gone(proc.pid)
        done = shards.finished_shards(out)
        assert 2 <= len(done) < n // shard_size
        assert (out / "_tmp").is_dir()  # img2dataset's scratch folder, left by the kill
        killed_hits = dict(hits)

        # the rerun (more threads: not an output setting, so it resumes) finishes the rest
        fast = slow.model_copy(update={"threads": shard_size})
        metrics = fetch_images.run(Source(kind="laion", repo="unused", fetch=fast), "k", filtered, tmp_path, out)
        for i, path in enumerate(paths):
            if i // shard_size in done:
                assert hits[path] == killed_hits[path] == 1, path  # finished before the kill: not fetched again
            else:
                assert hits[path] >= 1, path
        assert metrics["successes"] == metrics["samples"] == n and metrics["shards"] == n // shard_size
        assert sorted(p.name for p in out.iterdir()) == [fetch_state.FINGERPRINT_FILE] + [
            f"{shards.shard_name(s)}{ext}"
            for s in range(n // shard_size)
            for ext in (".parquet", ".tar", "_stats.json")
        ]
        for tar_path in out.glob("*.tar"):
            with tarfile.open(tar_path) as tar:  # complete, readable tars only
                assert len(tar.getmembers()) == 3 * shard_size

        # an uninterrupted run gives the same samples, byte for byte, and the same folder
        resumed_hits = dict(hits)
        fresh = tmp_path / "fresh"
        fetch_images.run(Source(kind="laion", repo="unused", fetch=fast), "k", filtered, tmp_path, fresh)
        assert _sample_set(out) == _sample_set(fresh)
        assert {(c, k) for k, c, _ in _sample_set(out)} == {
            (c, shards.sample_key(i, shard_size)[1]) for i, c in enumerate(captions)
        }
        assert tree_digest(out) == tree_digest(fresh)

        # a finished folder: a rerun fetches nothing and changes nothing
        fetch_images.run(Source(kind="laion", repo="unused", fetch=fast), "k", filtered, tmp_path, out)
        assert sum(hits.values()) == sum(resumed_hits.values()) + n
        assert tree_digest(out) == tree_digest(fresh)


def test_img2dataset_sigint_exit_0_becomes_an_interrupt():
    """img2dataset's SIGINT handler calls ``sys.exit(0)``: a stage must not end "successfully" on Ctrl-C."""
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt), url_fetch._interrupts_stay_interrupts():
        signal.signal(signal.SIGINT, lambda *_: None)  # as img2dataset.download does
        sys.exit(0)
    assert signal.getsignal(signal.SIGINT) is handler
    with pytest.raises(SystemExit), url_fetch._interrupts_stay_interrupts():
        sys.exit(3)


def test_local_kind_resumes_finished_shards_and_restarts_when_the_archives_change(tmp_path, monkeypatch):
    """fetch_images keeps a local kind's finished shards on rerun; a changed source file empties the folder."""
    from sdforge.ingest import reshard
    from tests.fixtures.sources import GREEN, RED, image_bytes, run_source, write_files

    repo = tmp_path / "repo"
    write_files(
        repo, {f"{i}.jpg": image_bytes(40, 40, RED) for i in range(6)} | {f"{i}.txt": f"c{i}" for i in range(6)}
    )
    source = Source(kind="local", repo=str(repo), allow_patterns=["*"], fetch={"image_size": 32, "shard_size": 2})
    _, first, out = run_source(source, "local", tmp_path / "work")
    assert (first["samples"], first["shards"]) == (6, 3)
    stats = sorted(out.glob("*_stats.json"))
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    stats[1].unlink()  # a shard the "kill" left unfinished

    converted = []
    real_convert = reshard.convert
    monkeypatch.setattr(reshard, "convert", lambda *a, **k: converted.append(1) or real_convert(*a, **k))
    meta, filtered = tmp_path / "work" / "metadata", tmp_path / "work" / "filtered"
    again = fetch_images.run(source, "local", filtered, meta, out)
    assert again == first
    assert len(converted) == 2  # only the unfinished shard's two images
    assert {p.name for p in out.iterdir()} == set(mtimes)
    assert stats[0].stat().st_mtime_ns == mtimes[stats[0].name]

    (meta / "5.jpg").write_bytes(image_bytes(48, 40, GREEN))  # same name, other file: not the same inputs
    converted.clear()
    fetch_images.run(source, "local", filtered, meta, out)
    assert len(converted) == 6
