"""Fixtures for the data stages: a tiny demo ``params.yaml`` in ``tmp_path`` and the stages before a test's.

``demo_params`` is the repo's ``params.yaml`` with small demo counts, small shards and a free
loopback port, written to ``tmp_path/params.yaml``; the test runs with ``tmp_path`` as working
directory, so the (relative) ``paths`` all land in ``tmp_path``, as DVC runs stages from the repo root.
Helpers are fixtures too (``run_until``, ``tree_digest``, ``free_port``).
"""

from __future__ import annotations

import hashlib
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from stages import download_metadata, filter_metadata, make_demo_data
from stages.config import Params, load_params

REPO = Path(__file__).resolve().parents[2]

TINY_DEMO = {
    "image_size": 40,
    "laion_rows": 24,
    "archive_images": 10,
    "low_aesthetic_rows": 3,
    "watermark_rows": 2,
    "nsfw_rows": 2,
    "small_rows": 2,
    "duplicate_rows": 4,
    "missing_rows": 3,
}
SHARD_SIZE = {"laion": 16, "diffusiondb": 4}


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tree_digest(root: Path) -> str:
    """SHA-256 over every file's relative path and bytes under ``root`` (what DVC's dir hash depends on)."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _tiny_params() -> dict[str, Any]:
    """The repo's params.yaml with tiny demo counts, small shards and a free port."""
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["demo"].update(TINY_DEMO, http_port=_free_port())
    data["tracking"]["mlflow_uri"] = "sqlite:///mlflow.db"
    demo_source = data["paths"]["demo_source"]
    for name, source in data["sources"].items():
        source["repo"] = f"{demo_source}/{name}"
        source.setdefault("fetch", {})["shard_size"] = SHARD_SIZE[name]
    return data


def write_params(directory: Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as ``directory/params.yaml`` and return its path."""
    path = directory / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def demo_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Params:
    """Tiny demo params written to ``tmp_path/params.yaml``; the test runs with ``tmp_path`` as cwd."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return load_params(write_params(tmp_path, _tiny_params()))


def _run_until(params: Params, stage: str) -> dict[str, dict]:
    """Run the data stages up to and including ``stage`` for every source; return their metrics."""
    order = ["make_demo_data", "download_metadata", "filter_metadata"]
    metrics: dict[str, dict] = {"make_demo_data": make_demo_data.run(params.demo, params.paths.demo_source)}
    for name, source in params.sources.items():
        if order.index(stage) >= 1:
            metrics[f"download_metadata@{name}"] = download_metadata.run(source, Path(params.paths.metadata) / name)
        if order.index(stage) >= 2:
            metrics[f"filter_metadata@{name}"] = filter_metadata.run(
                source, name, Path(params.paths.metadata) / name, Path(params.paths.filtered) / name
            )
    return metrics


@pytest.fixture
def run_until():
    """``run_until(params, stage)``: run the data stages up to ``stage`` through their ``run()``."""
    return _run_until


@pytest.fixture
def tree_digest():
    """``tree_digest(root)``: one hash over a folder's file names and bytes."""
    return _tree_digest


@pytest.fixture
def free_port():
    """``free_port()``: a loopback TCP port free right now."""
    return _free_port
