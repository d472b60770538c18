"""``sdforge preflight --out`` and ``tools.demo_recaption --out``: a scratch workspace replaces or reuses only a
folder it made itself (issue 55's audit: ``preflight --out DIR`` removed DIR whatever it held; ``demo_recaption
--out DIR`` replaced DIR's ``stages/``, ``sdforge/``, … with the repo's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sdforge.preflight.derive import Shrink
from tools import demo_recaption, preflight

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_dag(monkeypatch):
    """Nothing past the workspace runs here: a refused ``--out`` must stop before it (and a regression would
    otherwise start the whole DAG)."""

    def stop(*args, **kwargs):
        raise RuntimeError("the tool went past its workspace")

    monkeypatch.setattr(preflight, "write_samples", stop)
    real_run = demo_recaption.subprocess.run
    monkeypatch.setattr(
        demo_recaption.subprocess, "run", lambda cmd, **kw: stop() if "repro" in cmd else real_run(cmd, **kw)
    )


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): b"<dir>" if p.is_dir() else p.read_bytes() for p in folder.rglob("*")}


def _users_project(folder: Path) -> Path:
    """A folder of the user's that happens to look like a project: its own ``stages/`` and notes."""
    (folder / "stages").mkdir(parents=True)
    (folder / "stages/my_stage.py").write_text("print('mine')\n")
    (folder / "notes.md").write_text("a year of notes")
    return folder


def test_preflight_refuses_a_users_folder_and_leaves_it_byte_identical(tmp_path, capsys):
    mine = _users_project(tmp_path / "mine")
    before = _tree(tmp_path)
    status = preflight.main(["--params", str(REPO / "params.yaml"), "--out", str(mine), "--overlay", "none"])
    out = capsys.readouterr().out
    assert status == 1 and f"PREFLIGHT FAILED: --out {mine}: a folder with files that are not a previous " in out
    assert _tree(tmp_path) == before


def test_preflight_refuses_an_out_that_contains_the_current_directory(tmp_path, capsys, monkeypatch):
    (tmp_path / "here").mkdir()
    (tmp_path / "keep.txt").write_text("kept")
    monkeypatch.chdir(tmp_path / "here")
    status = preflight.main(["--params", str(REPO / "params.yaml"), "--out", "..", "--overlay", "none"])
    assert status == 1 and f"PREFLIGHT FAILED: --out {tmp_path}: contains the workspace" in capsys.readouterr().out
    assert (tmp_path / "keep.txt").read_text() == "kept"


def test_preflight_replaces_its_own_previous_workspace(tmp_path):
    full = yaml.safe_load((REPO / "params.yaml").read_text())
    ws = preflight.make_workspace(tmp_path / "ws", full, Shrink())
    (ws.root / "leftover.txt").write_text("from the last preflight")
    again = preflight.make_workspace(tmp_path / "ws", full, Shrink())
    assert (again.root / preflight.WORKSPACE_MARKER).is_file() and (again.root / "dvc.yaml").is_file()
    assert not (again.root / "leftover.txt").exists()


def test_demo_recaption_refuses_a_users_folder_and_leaves_it_byte_identical(tmp_path, capsys):
    mine = _users_project(tmp_path / "mine")
    before = _tree(tmp_path)
    assert demo_recaption.main(["--out", str(mine)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"--out {mine}: a folder with files that are not a previous demo_recaption workspace")
    assert "\n" not in err and _tree(tmp_path) == before


def test_demo_recaption_reuses_its_own_workspace_and_replaces_only_its_copy_of_the_code(tmp_path):
    out = tmp_path / "ws"
    demo_recaption.make_workspace(out)
    (out / "stages/stale_stage.py").write_text("# an older copy's file")
    (out / "results.txt").write_text("kept: the workspace's own results")
    demo_recaption.make_workspace(out)
    assert not (out / "stages/stale_stage.py").exists() and (out / "stages/train.py").is_file()
    assert (out / "results.txt").is_file() and (out / demo_recaption.WORKSPACE_MARKER).is_file()


def test_preflight_prunes_only_its_trained_run_dirs_and_checkpoints_no_later_stage_reads(tmp_path):
    phases = {"phase1": {"init_from": "scratch"}, "phase2": {"init_from": "phase1"}, "phase3": {"init_from": "phase2"}}
    ws = preflight.Workspace(tmp_path, {"phases": phases, "paths": {"runs": "runs", "checkpoints": "ckpts"}}, {})
    for folder in ("runs/phase1", "runs/phase2", "runs/phase3", "runs/notes", "ckpts/scratch", "ckpts/phase1",
                   "ckpts/phase2", "ckpts/mine"):  # fmt: skip
        (tmp_path / folder).mkdir(parents=True)
    order = ["eval_grid@scratch", "train@phase1", "eval_grid@phase1", "train@phase2", "eval_grid@phase2",
             "train@phase3", "eval_grid@phase3"]  # fmt: skip
    removed = preflight.prune(ws, set(order[:4]), order)
    assert sorted(Path(p).relative_to(tmp_path).as_posix() for p in removed) == [
        "ckpts/phase1", "ckpts/scratch", "runs/phase1", "runs/phase2"
    ]  # fmt: skip
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("*/*")) == [
        "ckpts/mine", "ckpts/phase2", "runs/notes", "runs/phase3"
    ]  # fmt: skip


def _refuses_a_users_folder(tool, name: str, tmp_path: Path, capsys) -> None:
    """``tool.main`` exits 2 with one line naming ``--out`` when it is a user's folder, which stays byte-identical."""
    mine = _users_project(tmp_path / "mine")
    before = _tree(tmp_path)
    assert tool.main(["--out", str(mine)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"--out {mine}: a folder with files that are not a previous {name} workspace")
    assert "\n" not in err and _tree(tmp_path) == before


def test_demo_mmdit_refuses_a_users_folder_and_its_params_are_the_mmdit_family(tmp_path, capsys):
    from sdforge.config import parse_params
    from tools import demo_mmdit

    _refuses_a_users_folder(demo_mmdit, "demo_mmdit", tmp_path, capsys)
    params = parse_params(demo_mmdit.mmdit_params())
    assert params.models.denoiser.family == "mmdit" and list(params.phases) == [f"phase{i}" for i in range(9)]
    assert params.phases["phase8"].adapter.targets == ["attention", "context_attention", "modulation"]
    assert params.eval.guidance_scale == 4.0 and params.eval.steps == 15  # the overlay's guidance, the demo's steps


def test_demo_mmdit_runs_its_stages_without_the_preflights_malloc_threshold(monkeypatch):
    from tools import demo_mmdit

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert "MALLOC_MMAP_THRESHOLD_" not in demo_mmdit.demo_env()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")  # the caller's own choice is kept
    assert demo_mmdit.demo_env()["MALLOC_MMAP_THRESHOLD_"] == "4096"


def test_demo_sdxl_refuses_a_users_folder_and_its_params_are_the_three_setups(tmp_path, capsys):
    from sdforge.config import parse_params
    from tools import demo_sdxl

    _refuses_a_users_folder(demo_sdxl, "demo_sdxl", tmp_path, capsys)
    params = parse_params(demo_sdxl.sdxl_params())
    assert params.models.denoiser.family == "sdxl"
    assert list(params.phases) == ["phase0", "phase1", "phase8", "phase8_te", "phase8_nf4"]
    setups = {p: params.phases[p].adapter for p in demo_sdxl.adapter_phases(demo_sdxl.sdxl_params())}
    assert {p: (a.text_encoders, a.base_precision) for p, a in setups.items()} == {
        "phase8": ([], "fp32"), "phase8_te": (["text_encoder", "text_encoder_2"], "fp32"), "phase8_nf4": ([], "nf4")}
    assert {params.phases[p].init_from for p in setups} == {"phase1"}


def test_demo_controlnet_takes_another_text_encoder_draw_into_its_workspace_params(tmp_path):
    from sdforge.config import load_params
    from tools import demo_controlnet

    first = demo_controlnet.make_workspace(tmp_path / "draw0")
    second = demo_controlnet.make_workspace(tmp_path / "draw1", text_encoder_seed=1)
    assert load_params(tmp_path / "draw0" / "params.yaml").models.text_encoder_seed == 0
    assert load_params(tmp_path / "draw1" / "params.yaml").models.text_encoder_seed == 1
    first["models"]["text_encoder_build"]["seed"] = 1  # the draw is the only difference
    assert first == second
