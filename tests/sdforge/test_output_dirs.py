"""``sdforge.output_dirs``: which folders a command may replace when the user names them."""

from __future__ import annotations

from pathlib import Path

import pytest

from sdforge.config import load_params
from sdforge.io import InputError
from sdforge.output_dirs import check_replaceable, check_scratch_dir, refuse_workspace_target, workspace_folders

REPO = Path(__file__).resolve().parents[2]


def test_workspace_folders_are_every_paths_key_and_the_folders_holding_them(tmp_path):
    folders = workspace_folders(load_params(REPO / "params.yaml").paths, [tmp_path])
    assert folders[f"paths.checkpoints ({tmp_path / 'checkpoints'})"] == tmp_path / "checkpoints"
    assert folders[f"paths.shards ({tmp_path / 'data/shards'})"] == tmp_path / "data/shards"
    assert tmp_path / "data" in folders.values()  # data/ holds metadata, shards, latents, …: the stages' own
    assert tmp_path not in folders.values()  # the workspace itself is not: an export may go in it


def test_a_symlink_or_a_detour_names_the_folder_it_leads_to(tmp_path):
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "ckpts")
    folders = {"paths.checkpoints": tmp_path / "ckpts"}
    for out in (tmp_path / "link/phase1", tmp_path / "x/../ckpts"):
        with pytest.raises(InputError, match="overlaps paths.checkpoints"):
            refuse_workspace_target(out, "--out", folders, [])
    refuse_workspace_target(tmp_path / "exports/sd", "--out", folders, [])  # beside it: fine


def test_check_replaceable_answers_for_each_kind_of_path(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours/MARK").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert check_replaceable(tmp_path / "new", "MARK", "x", "--out", overwrite=False) is False
    assert check_replaceable(tmp_path / "empty", "MARK", "x", "--out", overwrite=False) is False
    assert check_replaceable(tmp_path / "ours", "MARK", "x", "--out", overwrite=True) is True
    assert check_replaceable(tmp_path / "ours", "MARK", "x", "--out", overwrite=None) is True
    with pytest.raises(InputError, match="holds a previous x; pass --overwrite"):
        check_replaceable(tmp_path / "ours", "MARK", "x", "--out", overwrite=False)
    with pytest.raises(InputError, match="a dangling symlink"):
        check_replaceable(tmp_path / "dangling", "MARK", "x", "--out", overwrite=True)


def test_a_scratch_workspace_is_never_the_project_around_it_or_inside_its_code(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "stages").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for out, why in ((project, "contains the workspace"), (tmp_path, "contains the workspace"),
                     (project / "stages/ws", "overlaps the project's stages")):  # fmt: skip
        with pytest.raises(InputError, match=why):
            check_scratch_dir(out, ".mark", "scratch workspace", project, ["stages"])
    assert check_scratch_dir(project / ".scratch", ".mark", "scratch workspace", project, ["stages"]) is False
