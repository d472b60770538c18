"""The stage order comes from DVC's own graph, and the runner reports what DVC did."""

from __future__ import annotations

import os
import textwrap
import time

import pytest

from flows.dvc_ops.dag import all_stages, upstream_stages
from flows.dvc_ops.runner import StageFailed, run_dvc_stage
from tests.flows.conftest import make_mini_project


def test_upstream_stages_of_one_target_in_run_order(mini_project):
    assert upstream_stages(mini_project, "eval_grid@phase2") == ["prepare", "mix_phase@phase2", "eval_grid@phase2"]


def test_several_targets_tie_broken_by_declaration_order(mini_project):
    assert upstream_stages(mini_project, ["eval_grid@phase2", "eval_grid@phase1"]) == [
        "prepare",
        "mix_phase@phase1",
        "mix_phase@phase2",
        "eval_grid@phase1",
        "eval_grid@phase2",
    ]
    assert all_stages(mini_project)[:2] == ["prepare", "unrelated"]
    assert len(all_stages(mini_project)) == 6


def test_unknown_target_names_the_known_stages(mini_project):
    with pytest.raises(KeyError, match=r"unknown DVC stage\(s\) \['eval_grid@phase9'\].*mix_phase@phase1"):
        upstream_stages(mini_project, "eval_grid@phase9")


def test_runner_reports_ran_then_skipped(mini_project):
    lines: list[str] = []
    assert run_dvc_stage(mini_project, "prepare", log_line=lines.append).status == "ran"
    assert any("Running stage 'prepare'" in line for line in lines)
    assert (mini_project / "prepared.txt").read_text() == "prepared\n"
    assert run_dvc_stage(mini_project, "prepare", log_line=lines.append).status == "skipped"


def test_runner_failure_raises_with_output_tail(tmp_path):
    project = make_mini_project(
        tmp_path / "p",
        textwrap.dedent(
            """\
            stages:
              broken:
                cmd: echo "about to fail" && exit 3
                outs: [never.txt]
            """
        ),
    )
    with pytest.raises(StageFailed, match=r"(?s)broken exited \d+.*about to fail"):
        run_dvc_stage(project, "broken", log_line=lambda _: None)


def test_runner_timeout_kills_the_whole_process_group(tmp_path):
    project = make_mini_project(
        tmp_path / "p",
        textwrap.dedent(
            """\
            stages:
              slow:
                cmd: echo $$ > stage.pid && sleep 60 && echo done > slow.txt
                outs: [slow.txt]
            """
        ),
    )
    start = time.monotonic()
    with pytest.raises(StageFailed, match="timed out"):
        run_dvc_stage(project, "slow", log_line=lambda _: None, timeout_s=4)
    assert time.monotonic() - start < 20
    stage_pid = int((project / "stage.pid").read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and os.path.exists(f"/proc/{stage_pid}"):
        time.sleep(0.1)
    assert not os.path.exists(f"/proc/{stage_pid}"), "the stage command outlived dvc"
