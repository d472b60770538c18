"""fetch_images: img2dataset over the loopback demo (real CLI), DiffusionDB re-sharding, determinism."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import cv2
import numpy as np
import polars as pl
import pytest
import webdataset as wds

from stages import fetch_images, shards
from stages.common import InputError
from stages.demo_http import serve_directory

REPO = Path(__file__).resolve().parents[2]


def decode(jpeg: bytes) -> np.ndarray:
    assert jpeg[:2] == b"\xff\xd8", "not a JPEG"
    return cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_UNCHANGED)


def check_tar_layout(folder: Path) -> None:
    """Every tar's members are sorted, have a fixed mtime and come as jpg/json/txt triples."""
    for tar_path in sorted(folder.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            members = tar.getmembers()
        names = [m.name for m in members]
        assert names == sorted(names)
        assert {m.mtime for m in members} <= {0}
        assert [n.split(".", 1)[1] for n in names] == ["jpg", "json", "txt"] * (len(names) // 3)


def test_laion_cli_fetches_good_rows_from_the_loopback_server(demo_params, run_until, tmp_path):
    run_until(demo_params, "filter_metadata")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "stages.fetch_images", "--params", "params.yaml", "--item", "laion"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    demo = demo_params.demo
    good, tried = demo.laion_rows, demo.laion_rows + demo.missing_rows
    metrics = json.loads((tmp_path / "metrics" / "fetch_images" / "laion.json").read_text())
    assert metrics == {
        "samples": tried,
        "successes": good,
        "failed_to_download": demo.missing_rows,
        "failed_to_resize": 0,
        "success_rate": round(good / tried, 6),
        "shards": 2,
    }
    out = Path(demo_params.paths.shards) / "laion"
    assert sorted(p.name for p in out.iterdir()) == [
        f"0000{i}{ext}" for i in range(2) for ext in (".parquet", ".tar", "_stats.json")
    ]
    check_tar_layout(out)
    filtered = pl.read_parquet(Path(demo_params.paths.filtered) / "laion" / "filtered.parquet")
    caption_of = dict(filtered.select("url", "caption").iter_rows())
    samples = list(shards.iter_samples(out))
    assert len(samples) == good and len({k for k, _ in samples}) == good
    for key, sample in samples:
        meta = json.loads(sample["json"])
        assert meta["key"] == key and len(key) == 7  # shard_size 16: 2 digits per sample + 5 per shard
        assert sample["txt"].decode() == caption_of[meta["url"]] == meta["caption"]
        assert decode(sample["jpg"]).shape == (32, 32, 3)
        assert "/images/shape-" in meta["url"]
    tried_rows = pl.concat([pl.read_parquet(p) for p in sorted(out.glob("*.parquet"))])
    assert tried_rows.height == tried and tried_rows["key"].is_sorted()
    assert set(tried_rows.filter(pl.col("status") != "success")["error_message"]) == {"HTTP Error 404: File not found"}


def test_laion_without_server_warns_that_the_network_is_the_cause(demo_params, run_until, caplog):
    run_until(demo_params, "filter_metadata")
    source, paths = demo_params.sources["laion"], demo_params.paths
    with caplog.at_level(logging.WARNING, logger="stages.fetch_images"):
        metrics = fetch_images.run(
            source,
            "laion",
            Path(paths.filtered) / "laion",
            Path(paths.metadata) / "laion",
            Path(paths.shards) / "laion",
        )
    tried = demo_params.demo.laion_rows + demo_params.demo.missing_rows
    assert (metrics["samples"], metrics["successes"], metrics["failed_to_download"]) == (tried, 0, tried)
    assert metrics["success_rate"] == 0.0
    assert "DNS or network access is the likely cause" in caplog.text


def test_busy_demo_port_is_an_input_error(demo_params, run_until):
    run_until(demo_params, "filter_metadata")
    paths = demo_params.paths
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", demo_params.demo.http_port))
        busy.listen()
        with pytest.raises(InputError, match="change demo.http_port"):
            fetch_images.run(
                demo_params.sources["laion"],
                "laion",
                Path(paths.filtered) / "laion",
                Path(paths.metadata) / "laion",
                Path(paths.shards) / "laion",
                serve=(Path(paths.demo_source) / "http", demo_params.demo.http_port),
            )


def test_canonicalize_sorts_samples_and_fixes_mtime(tmp_path):
    path = tmp_path / "00000.tar"
    with wds.TarWriter(str(path)) as writer:
        for key in ("003", "001", "002"):
            writer.write({"__key__": key, "jpg": b"j" + key.encode(), "txt": key, "json": "{}"})
    assert shards.canonicalize_tar(path) == 3
    expected = shards.tar_bytes(
        {"__key__": k, "jpg": b"j" + k.encode(), "txt": k, "json": "{}"} for k in ("001", "002", "003")
    )
    assert path.read_bytes() == expected
    assert list(shards.read_tar(path)) == ["001", "002", "003"]


def test_demo_http_serves_files_and_404s(tmp_path, free_port):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.jpg").write_bytes(b"abc")
    with serve_directory(tmp_path, free_port()) as base:
        assert urllib.request.urlopen(f"{base}/images/a.jpg", timeout=5).read() == b"abc"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{base}/images/missing.jpg", timeout=5)
        assert err.value.code == 404
