"""Issue 39, case 7: no name a user gives a phase or a source makes DVC delete outside the stage's own folder.

DVC removes a stage's outputs before it runs the stage's command, so before the command can refuse a bad name:
with main's dvc.yaml, ``dvc repro -s train@..`` deleted the whole repository and ``train@../../escape`` a folder
beside it. The repo's real dvc.yaml is run here, by DVC itself, on a copy of the project whose params.yaml names
a phase and a source ``..`` and ``../../escape``; canaries inside and outside the repository must survive."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DVC = [sys.executable, "-m", "dvc"]
BAD_NAMES = ["..", "../../escape"]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """``<tmp>/repo``: a git + DVC project with the repo's dvc.yaml, code and demo params.yaml, plus phases and
    sources named :data:`BAD_NAMES`; canaries in ``<tmp>/escape`` and the project's own files."""
    root = tmp_path_factory.mktemp("names")
    repo = root / "repo"
    repo.mkdir()
    for name in ("stages", "sdforge", "model"):
        shutil.copytree(REPO / name, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "dvc.yaml", repo / "dvc.yaml")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    phase, source = next(iter(params["phases"].values())), next(iter(params["sources"].values()))
    for bad in BAD_NAMES:
        params["phases"][bad] = dict(phase)
        params["sources"][bad] = dict(source)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*DVC, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True, capture_output=True)
    subprocess.run([*git, "commit", "-qm", "project"], cwd=repo, check=True)
    return repo


def _canaries(repo: Path) -> list[Path]:
    """Files where a hostile name's output paths land: ``data/<kind>/..`` is ``data/``, ``checkpoints/..`` the
    repository, ``data/<kind>/../../escape`` is ``<repo>/escape``, ``checkpoints/../../escape`` beside the repo,
    ``metrics/<stage>/../../escape.json`` is ``<repo>/escape.json`` (likewise ``.parquet``, ``.csv``)."""
    placed = [repo.parent / "escape" / "canary.txt", repo / "escape" / "canary.txt", repo / "data" / "canary.txt",
              repo / "canary.txt", repo / "escape.json", repo / "escape.parquet", repo / "escape.csv"]  # fmt: skip
    for path in placed:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("keep")
    return [*placed, repo / "dvc.yaml", repo / "stages" / "train.py"]


DVC_STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
KEYED = sorted(name for name, stage in DVC_STAGES.items() if "foreach" in stage)


def test_every_output_a_name_reaches_is_persistent():
    """The rule the test below checks by running DVC, for every keyed output of every stage, present and future."""
    loose = []
    for name in KEYED:
        body = DVC_STAGES[name]["do"]
        for section in ("outs", "metrics", "plots"):
            for entry in body.get(section, []):
                path, opts = (entry, {}) if isinstance(entry, str) else next(iter(entry.items()))
                if "${key}" in path and not (opts or {}).get("persist"):
                    loose.append(f"{name}: {section} {path}")
    assert len(KEYED) == 9 and loose == []


@pytest.mark.parametrize("bad", BAD_NAMES)
@pytest.mark.parametrize("stage", KEYED)
def test_dvc_repro_single_item_with_a_hostile_name_deletes_nothing(project, stage, bad):
    canaries = _canaries(project)
    env = {**os.environ, "PYTHONPATH": str(project)}
    done = subprocess.run(
        [*DVC, "repro", "-s", f"{stage}@{bad}"], cwd=project, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0, done.stdout + done.stderr
    assert [c for c in canaries if not c.is_file()] == [], done.stdout + done.stderr
