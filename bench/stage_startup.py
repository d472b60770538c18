"""Benchmark: what a stage process costs before it does any work, ours vs an earlier commit.

``python -m bench.stage_startup [--quick] [--rounds N] [--baseline-rev REV]``

A DVC stage is a fresh ``python -m stages.<name>`` process; the demo DAG starts 44 of them. This measures,
per stage module, a process that does only what every stage does before its work: start the
interpreter, import ``stages.<name>``, load ``params.yaml`` and open and close its MLflow run (one metric
logged, on a fresh sqlite store in a temp dir; spooled for the deferrable stages where the tree has
``tracking.spool``). Ours is this tree; the baseline is ``--baseline-rev``
(default: the commit before issue 16's start-up work) exported with ``git archive`` and run the same way
with the same interpreter. Runs alternate (ours, baseline, ours, …); each stage's figure is its median.
The DAG total weights each stage by its instances in the demo DAG (``dvc.yaml`` foreach over 2 sources and
7 phases). ``--quick``: mix_phase, train and eval_grid, one round.

Last line: ``RESULT name=stage_startup ratio=<baseline DAG seconds / ours> ...``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._common import load_average, machine, result_line, run_measured

REPO = Path(__file__).resolve().parents[1]
BASELINE_REV = "fd2f14d"
"""The last commit before the start-up work of issue 16."""
INSTANCES = {
    "make_demo_data": 1,
    "download_metadata": 3,
    "filter_metadata": 3,
    "fetch_images": 3,
    "prepare_models": 1,
    "caption_images": 3,
    "encode_latents": 3,
    "mix_phase": 9,
    "train": 9,
    "eval_grid": 9,
}
"""Stage → its instances in the demo DAG (3 sources, phases 0-8)."""
DEFERRED = {"make_demo_data", "download_metadata", "filter_metadata", "fetch_images", "prepare_models",
            "caption_images", "encode_latents", "mix_phase"}  # fmt: skip
"""Stages whose run is deferrable (``tracking.spool``: spooled, replayed by the next direct run) in a tree that
has the spool; a tree without it opens them directly. eval_grid is probed direct: the demo's three sampled
grids open MLflow, its six skipped ones spool (so the DAG total here overstates ours)."""
QUICK = ("mix_phase", "train", "eval_grid")

PROBE = """
import importlib, sys
importlib.import_module("stages." + sys.argv[1])
from sdforge.config import load_params
from sdforge.tracking import stage_run
params = load_params(sys.argv[2])
try:  # a tree with tracking.spool spools a deferrable stage's run, as the stage does
    run = stage_run(params.tracking, "bench", sys.argv[1], {"probe": 1}, deferrable=sys.argv[3] == "1")
except TypeError:  # a tree from before tracking.spool
    run = stage_run(params.tracking, "bench", sys.argv[1], {"probe": 1})
with run as mlflow:
    mlflow.log_metrics({"probe": 1.0})
"""


def export_tree(rev: str, dest: Path) -> Path:
    """``git archive rev`` unpacked into ``dest`` (created)."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def probe_once(tree: Path, stage: str, workdir: Path) -> float:
    """Wall seconds of one probe process for ``stage`` with ``tree`` first on the path, cwd ``workdir``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "MLFLOW_TRACKING_URI": f"sqlite:///{workdir / 'mlflow.db'}"}
    env["PYTHONDONTWRITEBYTECODE"] = "0"
    deferrable = "1" if stage in DEFERRED else "0"
    command = [sys.executable, "-c", PROBE, stage, str(tree / "params.yaml"), deferrable]
    measured = run_measured(command, env=env, cwd=workdir)
    shutil.rmtree(workdir / "mlflow.db.spool", ignore_errors=True)  # a later direct probe must not replay it
    if measured.returncode != 0:
        raise SystemExit(f"bench.stage_startup: probing stages.{stage} in {tree} failed (exit {measured.returncode})")
    return measured.wall_s


def main(argv: list[str] | None = None) -> None:
    """CLI: probe every stage for both trees, print the table and the RESULT line."""
    parser = argparse.ArgumentParser(prog="python -m bench.stage_startup")
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)}; one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-rev", default=BASELINE_REV)
    args = parser.parse_args(argv)
    stages = QUICK if args.quick else tuple(INSTANCES)
    rounds = 1 if args.quick else args.rounds
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="stage-startup-") as tmp:
        trees = {"ours": REPO, "baseline": export_tree(args.baseline_rev, Path(tmp) / "baseline")}
        missing = [s for s in stages if not (trees["baseline"] / "stages" / f"{s}.py").is_file()]
        if missing:
            print(f"not in the baseline tree (left out of both totals): {', '.join(missing)}")
            stages = tuple(s for s in stages if s not in missing)
        for tree in trees.values():  # warm-up: byte-compile both trees, create the sqlite schema
            probe_once(tree, stages[0], Path(tmp))
        times = {name: {s: [] for s in stages} for name in trees}
        for _ in range(rounds):
            for stage in stages:
                for name, tree in trees.items():
                    times[name][stage].append(probe_once(tree, stage, Path(tmp)))
    median = {name: {s: statistics.median(v) for s, v in per.items()} for name, per in times.items()}
    print("| stage (instances) | ours s | baseline s |")
    print("|---|---|---|")
    for stage in stages:
        print(f"| {stage} ({INSTANCES[stage]}) | {median['ours'][stage]:.2f} | {median['baseline'][stage]:.2f} |")
    total = {name: sum(INSTANCES[s] * t for s, t in m.items()) for name, m in median.items()}
    print(
        result_line(
            "stage_startup",
            total["baseline"] / total["ours"],
            dag_s_ours=total["ours"],
            dag_s_baseline=total["baseline"],
            stages=len(stages),
            rounds=rounds,
            baseline_rev=args.baseline_rev,
            load_avg=f"{load_before} -> {load_average()}",
            machine=machine(),
        )
    )


if __name__ == "__main__":
    main()
