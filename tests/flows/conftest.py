"""Fixtures for the flow tests: tiny DVC projects in tmp dirs and a real local Prefect stack."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]

for _key, _value in {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "DVC_NO_ANALYTICS": "1",
}.items():
    os.environ.setdefault(_key, _value)

MINI_DVC_YAML = textwrap.dedent(
    """\
    stages:
      prepare:
        cmd: echo prepared > prepared.txt
        outs: [prepared.txt]
      unrelated:
        cmd: echo unrelated > unrelated.txt
        outs: [unrelated.txt]
      mix_phase:
        foreach: ${phases}
        do:
          cmd: echo "mix ${key}" > mix-${key}.txt
          deps:
            - prepared.txt
          outs:
            - mix-${key}.txt
      eval_grid:
        foreach: ${phases}
        do:
          cmd: cat mix-${key}.txt > grid-${key}.txt && echo "grid ${key}" >> grid-${key}.txt
          deps:
            - mix-${key}.txt
          outs:
            - grid-${key}.txt
    """
)

MINI_PHASES = ("phase1", "phase2")


def _mini_params() -> dict:
    """The repo's params.yaml with two phases (so it still validates with ``load_params``)."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    phases = list(params["phases"].items())[: len(MINI_PHASES)]
    params["phases"] = dict(phases)
    return params


def make_mini_project(path: Path, dvc_yaml: str = MINI_DVC_YAML) -> Path:
    """A git + DVC project with ``dvc_yaml``, the repo's ``flows``/``stages`` linked in, and prefect.yaml."""
    path.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    subprocess.run(["git", "init", "-q"], cwd=path, check=True, env=env)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=path, check=True, env=env)
    subprocess.run([sys.executable, "-m", "dvc", "config", "core.analytics", "false"], cwd=path, check=True, env=env)
    (path / "dvc.yaml").write_text(dvc_yaml)
    (path / "params.yaml").write_text(yaml.safe_dump(_mini_params(), sort_keys=False))
    for package in ("flows", "stages"):
        (path / package).symlink_to(REPO / package, target_is_directory=True)
    shutil.copy(REPO / "prefect.yaml", path / "prefect.yaml")
    return path


@pytest.fixture
def mini_project(tmp_path: Path) -> Path:
    return make_mini_project(tmp_path / "project")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def prefect_stack(tmp_path_factory: pytest.TempPathFactory):
    """A real Prefect server + process worker on a free loopback port, deployed from a mini project's
    copy of the repo's prefect.yaml. Torn down worker first (SIGINT), then the server."""
    from flows.stack import Stack

    base = tmp_path_factory.mktemp("stack")
    stack = Stack(
        root=make_mini_project(base / "project"),
        home=base / "prefect-home",
        state_dir=base / "state",
        port=free_port(),
        query_seconds=1,
    )
    try:
        stack.up()
        yield stack
    finally:
        stack.down()
        for name in ("server", "worker"):
            log = stack.state_dir / f"{name}.log"
            if log.exists():
                print(f"--- {name}.log (tail) ---\n" + log.read_text()[-3000:])


@pytest.fixture
def prefect_api(prefect_stack):
    """Point this process's Prefect client at the test stack (no temporary server per flow call)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: prefect_stack.api_url, PREFECT_HOME: prefect_stack.home}):
        yield prefect_stack.api_url
