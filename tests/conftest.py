"""Fixtures shared by every test package: a real S3 (moto server) on loopback, the tiny demo data params, the tiny
training workspace's phase 1 trained straight through (the reference every resume test compares with)."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from sdforge.config import Params, load_params
from tests.fixtures import demo_data, training
from tests.fixtures.suite import heaviest_first


@dataclass
class MotoS3:
    """A fresh bucket on the session's moto server; boto3 in this process (and children) points at it."""

    endpoint: str
    bucket: str
    client: Any

    def url(self, prefix: str = "") -> str:
        return f"s3://{self.bucket}/{prefix}".rstrip("/")


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread in this process and, through ``OMP_NUM_THREADS``, in every process a test starts (stages,
    ``dvc repro``, torchrun ranks), unless the environment sets another count. The tests' models are tiny, and on a
    2-core machine a 2-thread process beside another busy one spins in OpenMP's barriers: the tiny workspace's
    6-step train took ~60-90 s that way and ~5 s on one thread. Every run of a test (reference and resumed alike)
    gets the same count, so the bit-identity checks compare like with like."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The heaviest modules first (tests/fixtures/suite.py): ``make test`` hands modules to its xdist workers in
    this order."""
    items[:] = [items[i] for i in heaviest_first([item.nodeid for item in items])]


@pytest.fixture(scope="session")
def straight_phase1(tmp_path_factory) -> Path:
    """The tiny training workspace (tests/fixtures/training.py) with phase 1 trained uninterrupted by the stage CLI:
    the reference of the resume tests. Shared: read it, clone it to change it (``training.clone_workspace``)."""
    root = tmp_path_factory.mktemp("straight-phase1")
    done = training.train(training.build_workspace(root), "phase1")
    assert done.returncode == 0, done.stderr[-3000:]
    return root


@pytest.fixture
def fresh_workspace(straight_phase1: Path, tmp_path: Path) -> Path:
    """A tiny training workspace in ``tmp_path`` as ``training.build_workspace`` leaves it (models, latents, mixes;
    nothing trained), copied from the shared one instead of rebuilt; its params file."""
    return training.untrained_clone(straight_phase1, tmp_path)


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """A ``moto`` S3 server (``ThreadedMotoServer``) on a free 127.0.0.1 port; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def moto_s3(moto_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> MotoS3:
    """Dummy credentials + ``AWS_ENDPOINT_URL`` (honoured by boto3 natively) and a new empty bucket."""
    import boto3

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": moto_server,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    client = boto3.client("s3")
    bucket = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return MotoS3(moto_server, bucket, client)


@pytest.fixture(autouse=True)
def _mlflow_state_is_per_test() -> Iterator[None]:
    """``mlflow.set_tracking_uri`` also exports ``MLFLOW_TRACKING_URI``, and a test may leave a run open:
    undo both after every test, so one test's store never becomes the next one's."""
    import os
    import sys

    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if "mlflow" in sys.modules:
        mlflow = sys.modules["mlflow"]
        while mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(before)
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


@pytest.fixture
def demo_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Params:
    """Tiny demo params written to ``tmp_path/params.yaml``; the test runs with ``tmp_path`` as cwd."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return load_params(demo_data.write_params(tmp_path, demo_data.tiny_params()))


@pytest.fixture
def run_until():
    """``run_until(params, stage)``: run the data stages up to ``stage`` through their ``run()``."""
    return demo_data.run_until


@pytest.fixture
def tree_digest():
    """``tree_digest(root)``: one hash over a folder's file names and bytes."""
    return demo_data.tree_digest


@pytest.fixture
def free_port():
    """``free_port()``: a loopback TCP port free right now."""
    return demo_data.free_port
