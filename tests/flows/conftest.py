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
    params["phases"] = {name: params["phases"][name] for name in MINI_PHASES}
    params["phases"][MINI_PHASES[0]]["init_from"] = "scratch"  # the demo's phase 1 starts from phase 0
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
    from tools.stack import Stack

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


# --- a tiny project whose every stage has deps (so DVC's run cache can restore it) and whose train
# stage checkpoints to S3 and resumes from there, like stages/train.py with train.checkpoint_s3 ---------
REMOTE_DVC_YAML = textwrap.dedent(
    """\
    stages:
      prepare:
        cmd: python fake_stage.py prepare
        deps: [fake_stage.py]
        outs: [prepared.txt]
        metrics:
          - metrics/prepare.json:
              cache: false
      mix_phase:
        foreach: ${phases}
        do:
          cmd: python fake_stage.py mix_phase ${key}
          deps:
            - fake_stage.py
            - prepared.txt
          outs:
            - mix-${key}.txt
          metrics:
            - metrics/mix_phase/${key}.json:
                cache: false
      train:
        foreach: ${phases}
        do:
          cmd: python fake_stage.py train ${key}
          deps:
            - fake_stage.py
            - mix-${key}.txt
          params: [train]
          outs:
            - model-${key}.txt
          metrics:
            - metrics/train/${key}.json:
                cache: false
      eval_grid:
        foreach: ${phases}
        do:
          cmd: python fake_stage.py eval_grid ${key}
          deps:
            - fake_stage.py
            - model-${key}.txt
          outs:
            - grid-${key}.txt
          metrics:
            - metrics/eval_grid/${key}.json:
                cache: false
    """
)

FAKE_FINGERPRINT = "fake0000fake0000"
"""The fake train stage's run fingerprint: its S3 folder is ``ckpts/<phase>/<it>/``."""

FAKE_STAGE = textwrap.dedent(
    """\
    '''Stand-ins for the real stages. Each appends its name to ran.log (untracked: what ran *here*).
    train: TRAIN_STEPS checkpoints like stages/train.py, each uploaded to train.checkpoint_s3 at once,
    resuming from the newest of local disk and S3; FAKE_TRAIN_DIE_AT=N SIGKILLs it after step N.'''
    import json, os, signal, sys
    from pathlib import Path

    sys.path.insert(0, {repo!r})
    TRAIN_STEPS = 4
    FAKE_FINGERPRINT = "{fingerprint}"
    stage, item = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    with open("ran.log", "a") as log:
        log.write(f"{{stage}}@{{item}}\\n" if item else f"{{stage}}\\n")
    metrics_file = Path("metrics") / (f"{{stage}}/{{item}}.json" if item else f"{{stage}}.json")
    metrics_file.parent.mkdir(parents=True, exist_ok=True)
    if stage == "prepare":
        Path("prepared.txt").write_text("prepared\\n")
        metrics = {{"rows": 3}}
    elif stage == "mix_phase":
        Path(f"mix-{{item}}.txt").write_text(Path("prepared.txt").read_text() + f"mix {{item}}\\n")
        metrics = {{"samples": 3}}
    elif stage == "train":
        from sdforge.training.resume import resume_point
        from sdforge.config import load_params
        from sdforge.training.s3_checkpoints import RemoteRun, run_url
        from sdforge.tracking import log_stage
        from tests.fixtures.checkpoints import save

        params = load_params("params.yaml")
        s3_url, run_dir = params.train.checkpoint_s3, Path("runs") / item
        remote = run_url(s3_url, item, FAKE_FINGERPRINT)
        found = resume_point(run_dir, remote=remote)
        start = int(found[1]["v"].item()) if found else 0
        die_at = int(os.environ.get("FAKE_TRAIN_DIE_AT", "0"))
        for step in range(start + 1, TRAIN_STEPS + 1):
            RemoteRun(remote).upload(save(run_dir, step))
            if step == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
        Path(f"model-{{item}}.txt").write_text(f"model {{item}} after {{TRAIN_STEPS}} steps\\n")
        metrics = {{"resumed_from_step": start, "steps": TRAIN_STEPS}}
        if os.environ.get("FAKE_TRAIN_MLFLOW"):
            log_stage(params.tracking, item, f"train@{{item}}", metrics, params=params.model_dump())
    else:
        Path(f"grid-{{item}}.txt").write_text(Path(f"model-{{item}}.txt").read_text() + "grid\\n")
        metrics = {{"score": 0.5}}
        if os.environ.get("FAKE_TRAIN_MLFLOW"):  # tagged like stages/eval_grid.py: "eval_grid" under the phase
            from sdforge.config import load_params
            from sdforge.tracking import log_stage

            log_stage(load_params("params.yaml").tracking, item, "eval_grid", metrics)
    metrics_file.write_text(json.dumps(metrics))
    """
)


def make_remote_project(path: Path, moto_s3, phases: tuple[str, ...] = MINI_PHASES) -> Path:
    """A committed git + DVC project (REMOTE_DVC_YAML) whose params name ``moto_s3`` as DVC remote and
    checkpoint store. Credentials stay in the environment (the moto fixture's AWS chain)."""
    make_mini_project(path, REMOTE_DVC_YAML)
    (path / "fake_stage.py").write_text(FAKE_STAGE.format(repo=str(REPO), fingerprint=FAKE_FINGERPRINT))
    params = yaml.safe_load((path / "params.yaml").read_text())
    params["phases"] = {k: v for k, v in params["phases"].items() if k in phases}
    params["storage"] = {
        "dvc_remote": moto_s3.url("dvcstore"),
        "endpoint_url": moto_s3.endpoint,
        "mlflow_artifacts": moto_s3.url("mlflow"),
    }
    params["train"]["checkpoint_s3"] = moto_s3.url("ckpts")
    params["tracking"]["mlflow_uri"] = f"sqlite:///{path / 'mlflow.db'}"
    (path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (path / ".gitignore").write_text("/ran.log\n/runs/\n/mlflow.db\n/mlruns/\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "-A"], cwd=path, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "project"], cwd=path, check=True)
    return path


def fresh_clone(project: Path, dest: Path) -> Path:
    """What a new pod has: the git repo only (no DVC cache, no outputs, no dvc.lock unless committed)."""
    subprocess.run(["git", "clone", "-q", str(project), str(dest)], check=True)
    return dest


def ran_here(project: Path) -> list[str]:
    log = project / "ran.log"
    return log.read_text().split() if log.exists() else []


def artifacts_of(flow_run_id) -> dict[str, object]:
    """The Prefect artifacts of one flow run, by key (or type when it has no key)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    of_run = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=of_run, limit=200)
    return {(a.key or a.type): a for a in found}
