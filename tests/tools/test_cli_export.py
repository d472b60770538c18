"""``sdforge export --out``: never a folder of the workspace, one that contains it, or a folder the export did not
write (issue 55: ``--out`` was deleted whatever it held, ``--out checkpoints/phase1`` replaced a phase)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from sdforge.eval.export import EXPORT_MARKER
from tests.fixtures.eval_workspace import make_workspace, write_params
from tools.cli import main


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A workspace whose relative ``paths`` (data/…, runs) resolve inside it: the tests run from its root."""
    root = tmp_path_factory.mktemp("cli-export")
    models, ckpt = make_workspace(root)
    params = write_params(root, models, ckpt.parent)
    for folder in ("data/shards/laion", "runs/phase1", "eval/phase1"):
        (root / folder).mkdir(parents=True)
        (root / folder / "progress.bin").write_bytes(b"hours of work")
    return root, params


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): b"<dir>" if p.is_dir() else p.read_bytes() for p in folder.rglob("*")}


def _export(caplog, params: Path, out: str, *flags: str) -> tuple[int, list[str]]:
    """``sdforge export --params params --out out flags``: its exit status and its ERROR lines."""
    caplog.clear()
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as exit_:
        main(["export", "--params", str(params), "--checkpoint", str(params.parent / "checkpoints/phase1"), "--out",
              out, *flags])  # fmt: skip
    return exit_.value.code, [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


OUTS = {
    "the phase's checkpoint": ("checkpoints/phase1", "overlaps --checkpoint"),
    "another phase's checkpoint": ("checkpoints/phase2", "paths.checkpoints"),
    "the checkpoints folder": ("checkpoints", "paths.checkpoints"),
    "inside the phase's checkpoint": ("checkpoints/phase1/export", "overlaps --checkpoint"),
    "a relative data folder": ("data/shards/laion", "paths.shards"),
    "a new folder in data": ("data/exports/sd", "paths."),  # paths.* lie in data/ (the stages' own)
    "a run dir": ("runs/phase1", "paths.runs"),
    "the models": ("models", "paths.models"),
    "eval": ("eval/phase1", "paths.eval"),
    "a detour through ..": ("elsewhere/../checkpoints/phase2", "paths.checkpoints"),
    "the workspace": (".", "contains the workspace"),
    "above the workspace": ("..", "contains the workspace"),
}


@pytest.mark.parametrize("case", list(OUTS))
def test_out_in_or_around_the_workspace_is_refused_in_one_line(project, caplog, monkeypatch, case):
    root, params = project
    monkeypatch.chdir(root)
    out, named = OUTS[case]
    before = _tree(root)
    code, errors = _export(caplog, params, out, "--overwrite")
    assert code == 2 and len(errors) == 1 and "\n" not in errors[0], errors
    assert errors[0].startswith(f"--out {out}: ") and named in errors[0]
    assert _tree(root) == before  # nothing deleted, nothing written


def test_a_symlink_into_the_checkpoints_is_refused(project, caplog, monkeypatch, tmp_path):
    root, params = project
    monkeypatch.chdir(tmp_path)  # the workspace is only the params file's folder here
    (tmp_path / "link").symlink_to(root / "checkpoints")
    before = _tree(root)
    code, errors = _export(caplog, params, str(tmp_path / "link/phase2"))
    assert code == 2 and "overlaps the workspace folder paths.checkpoints" in errors[0]
    assert _tree(root) == before


def test_a_users_folder_is_refused_and_a_previous_export_needs_overwrite(project, caplog, capsys, tmp_path):
    _, params = project
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("three years")
    code, errors = _export(caplog, params, str(mine))
    assert code == 2 and errors == [
        f"--out {mine}: a folder with files that are not a previous export (no {EXPORT_MARKER} in it); nothing was "
        "written: pick a new or empty folder"
    ]
    assert [p.name for p in tmp_path.iterdir()] == ["mine"] and (mine / "thesis.tex").read_text() == "three years"

    out = tmp_path / "sd"
    assert _export(caplog, params, str(out)) == (0, [])
    assert json.loads((out / EXPORT_MARKER).read_text())["weights"] == "ema"
    code, errors = _export(caplog, params, str(out), "--live")
    assert code == 2 and "holds a previous export; pass --overwrite to replace it" in errors[0]
    assert _export(caplog, params, str(out), "--live", "--overwrite") == (0, [])
    assert json.loads((out / EXPORT_MARKER).read_text())["weights"] == "live"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "sd"]
    assert capsys.readouterr().out.split() == [str(out), str(out)]
