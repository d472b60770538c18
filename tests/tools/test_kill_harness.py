"""tools.kill_harness: SIGKILL ``dvc repro`` mid-stage, rerun, nothing completed reruns, nothing is left behind.

The fast test drives the harness's kill machinery on a three-stage project (a resumable middle
stage); the slow one runs the harness itself on the real (shrunken) DAG with a few kill points.
"""

from __future__ import annotations

import argparse
import collections
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tools import kill_harness as kh
from tools.kill_checks import lock_outs

# `count` appends one line per 0.2 s to counts.txt up to 15 and resumes from what is there
COUNT = textwrap.dedent("""\
    import pathlib, time
    p = pathlib.Path("counts.txt")
    done = len(p.read_text().splitlines()) if p.exists() else 0
    for i in range(done, 15):
        with p.open("a") as f:
            f.write(f"{i}\\n")
        time.sleep(0.2)
    pathlib.Path("counted.txt").write_text(p.read_text())
""")
DVC_YAML = textwrap.dedent("""\
    stages:
      first:
        cmd: echo first > first.txt
        outs: [first.txt]
      count:
        cmd: python count.py
        deps: [first.txt, count.py]
        outs: [counted.txt]
      last:
        cmd: cat counted.txt > last.txt
        deps: [counted.txt]
        outs: [last.txt]
""")


# `train` writes a checkpoint the way sdforge/training/checkpoints.py does: a .tmp dir, renamed when complete
SAVE = textwrap.dedent("""\
    import pathlib, shutil, time
    run = pathlib.Path("runs/phase1")
    run.mkdir(parents=True, exist_ok=True)
    time.sleep(1.0)
    tmp = run / "checkpoint-1.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    time.sleep(1.0)
    tmp.rename(run / "checkpoint-1")
    pathlib.Path("saved.txt").write_text("ok")
""")
DVC_YAML += "  train:\n    cmd: python save.py\n    deps: [last.txt]\n    outs: [saved.txt]\n"


@pytest.fixture
def mini(tmp_path: Path) -> Path:
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    (tmp_path / "count.py").write_text(COUNT)
    (tmp_path / "save.py").write_text(SAVE)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    kh._dvc(tmp_path, "init", "-q")
    return tmp_path


def test_kill_mid_stage_then_rerun_skips_completed_and_finishes(mini):
    rng = random.Random(0)
    durations = {"count": 3.0}
    killed = kh.run_killable(mini, ["repro", "last"], "count", rng, durations, log=lambda _: None)
    assert killed.killed_in == "count" and killed.leftover_pids == []
    assert killed.ran == ["first", "count"] and killed.completed == ["first"]
    partial = (mini / "counts.txt").read_text().splitlines()
    assert 0 < len(partial) < 15 and not (mini / "counted.txt").exists()

    again = kh.run_killable(mini, ["repro", "last"], None, rng, durations, log=lambda _: None)
    assert again.rc == 0 and again.killed_in is None
    assert again.skipped == ["first"] and again.ran == ["count", "last"]  # completed `first` not rerun
    assert (mini / "last.txt").read_text().splitlines() == [str(i) for i in range(15)]  # resumed, not restarted
    assert kh._dvc(mini, "status", "--json", "last").stdout.strip() in ("{}", "")


def test_checkpoint_kill_lands_in_a_write_and_ignores_one_left_by_an_earlier_kill(mini):
    rng = random.Random(0)
    for _ in range(2):  # the second attempt starts with the first one's checkpoint-1.tmp on disk
        att = kh.run_killable(mini, ["repro"], "checkpoint", rng, {}, log=lambda _: None)
        assert att.killed_in == "train+ckpt" and att.killed_at_s >= 0.9  # not at the stale .tmp
        assert (mini / "runs/phase1/checkpoint-1.tmp").is_dir()
    done = kh.run_killable(mini, ["repro"], None, rng, {}, log=lambda _: None)
    assert done.rc == 0 and done.ran == ["train"] and (mini / "runs/phase1/checkpoint-1").is_dir()


def test_summary_line_counts_kills_by_stage():
    ep = kh.Episode(kills=[kh.Kill(0, "train", "train@phase1", 1.0, 0),
                           kh.Kill(0, "checkpoint", "train@phase2+ckpt", 0.5, 0),
                           kh.Kill(0, "push", "push", 0.3, 0)])
    report, ok = kh.summarize([ep], 10.0)
    assert ok
    assert report.splitlines()[-1] == ("RESULT kills=3 landed=push:1,train:1,train+ckpt:1 corrupt=0 reruns=0 "
                                       "leftover_pids=0 hash_equal=true outs_equal=true ok=true")
    ep.reruns.append("prepare_models")
    assert kh.summarize([ep], 10.0)[1] is False


@pytest.mark.slow
def test_harness_on_the_shrunken_dag(tmp_path):
    """Reference run, then kills inside fetch, train and a checkpoint write, and a killed push."""
    proc = subprocess.run(
        [sys.executable, "-m", "tools.kill_harness", "--seed", "1", "--workdir", str(tmp_path),
         "--targets", "fetch_images", "train", "checkpoint", "push"],
        cwd=kh.REPO, capture_output=True, text=True, timeout=1800,
    )
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert last.startswith("RESULT kills=4 ") and "corrupt=0 reruns=0" in last and "hash_equal=true" in last


def test_a_target_can_name_one_stage_and_keeps_its_place_in_dag_order():
    assert kh.kill_target("caption_images@webdump") == "caption_images@webdump"
    with pytest.raises(argparse.ArgumentTypeError):
        kh.kill_target("nonsense@webdump")
    order = ["make_demo_data", "prepare_models", "caption_images@laion", "caption_images@webdump", "train@phase1"]
    got = kh.order_targets(collections.deque(["train", "caption_images@webdump", "prepare_models"]), order)
    assert list(got) == ["prepare_models", "caption_images@webdump", "train"]


def test_outputs_that_hold_timings_are_left_out_of_the_byte_comparison(tmp_path):
    stages = {
        "train@phase1": {
            "outs": [{"path": "checkpoints/phase1", "md5": "a"}, {"path": "metrics/train/p1.json", "md5": "b"}]
        },
        "report": {"outs": [{"path": "eval/report.html", "md5": "c"}]},
        "eval_grid@phase1": {"outs": [{"path": "eval/phase1", "md5": "d"}]},
    }
    (tmp_path / "dvc.lock").write_text(yaml.safe_dump({"schema": "2.0", "stages": stages}))
    assert lock_outs(tmp_path) == {"train@phase1:checkpoints/phase1": "a", "eval_grid@phase1:eval/phase1": "d"}
