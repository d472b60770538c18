"""The Prefect tasks of the project and the loop that runs a stage list.

Per stage: restore its outputs from the DVC remote if they were pushed for the same inputs (a fresh
clone or pod), ``dvc repro --single-item`` it, push its outputs and run-cache entry, and publish a
markdown artifact with its metrics. The flow's progress is a progress artifact updated per stage; when
the loop ends (done or failed) a table artifact tells what happened to every stage, and a failure gets an
artifact of its own (flows/run_artifacts.py). Network work (downloads, restore, push) is retried with
backoff; every subprocess has a timeout.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows.dvc_ops.runner import StageFailed, run_dvc_stage, stage_env
from flows.run_artifacts import (
    StageRow,
    artifact_key,
    publish_failure,
    publish_stage_artifact,
    publish_stage_table,
    stage_run_url,
)
from sdforge.config import Tracking, load_params
from sdforge.training.exits import RETRYABLE

NETWORK_STAGE_PREFIXES = ("download_metadata", "fetch_images")
"""Stages that talk to the network: a failure there is often transient, so they are retried."""
NETWORK_RETRIES = 2
NETWORK_RETRY_DELAY_S = [30, 120]
REMOTE_RETRIES = 3
"""Restore/push talk to S3: retried after 10, 20, 40 s (± jitter)."""
REMOTE_TIMEOUT_S = 3600.0
"""Ceiling for one restore or push (a phase's checkpoints are GBs)."""


def is_network_stage(stage: str) -> bool:
    return stage.split("@", 1)[0] in NETWORK_STAGE_PREFIXES


@dataclass(frozen=True)
class RunOptions:
    """What the flows pass down to each stage."""

    dry_run: bool = False
    timeout_s: float | None = None
    force_stage: str | None = None
    """``dvc repro --force --single-item`` this stage (the others are run as usual)."""
    use_remote: bool = True
    """With a default DVC remote (``storage.dvc_remote``): restore before, push after each stage."""
    metrics_dir: str = "metrics"
    tracking: Tracking | None = None
    """Where the stages' MLflow runs are, for the artifacts' links; None: ``tracking`` of ``<root>/params.yaml``."""


class StageProgress:
    """Forward a stage's output lines to ``log``; a progress-bar line (tqdm's ``12/300 [``) updates the
    stage's progress artifact instead, and is logged at most every ``every_s`` seconds."""

    BAR = re.compile(r"(\d+)/(\d+) \[")

    def __init__(self, stage: str, log, every_s: float = 10.0):
        self.stage, self.log, self.every_s = stage, log, every_s
        self.artifact = None
        self.last = float("-inf")

    def __call__(self, line: str) -> None:
        bars = self.BAR.findall(line)
        if not bars or int(bars[-1][1]) <= 0:
            self.log(line)
            return
        done, total = map(int, bars[-1])
        now = time.monotonic()
        if now - self.last < self.every_s and done < total:
            return
        self.last = now
        percent = min(100.0, 100.0 * done / total)
        if self.artifact is None:
            key = artifact_key("progress", self.stage)
            self.artifact = create_progress_artifact(percent, key=key, description=f"{self.stage}: {done}/{total}")
        else:
            update_progress_artifact(self.artifact, percent, description=f"{self.stage}: {done}/{total}")
        self.log(line.strip())


# DVC is the cache (it skips a stage whose deps, params and outs are unchanged): no Prefect caching.
@task(name="dvc-stage", task_run_name="{stage}", retries=0, cache_policy=NO_CACHE)
def repro_stage(root: str, stage: str, timeout_s: float | None = None, force: bool = False) -> dict:
    """``dvc repro --single-item <stage>`` (``--force`` with ``force``); the output goes to the Prefect log,
    progress bars to a progress artifact."""
    logger = get_run_logger()
    log_line = StageProgress(stage, logger.info)
    outcome = run_dvc_stage(root, stage, log_line=log_line, timeout_s=timeout_s, force=force)
    logger.info("stage %s: %s in %.1f s", stage, outcome.status, outcome.seconds)
    return asdict(outcome)


TRAIN_RETRIES = 3
"""A train stage that stopped on a preemption notice or a hang (exit 75/76: sdforge.training.exits) is rerun:
it resumes from its newest checkpoint. Other failures are not retried (a bug or bad input fails the same way)."""
TRAIN_RETRY_DELAY_S = 10


def _retryable_train_failure(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: the stage's command exited with a retryable status (DVC says "exited with N")."""
    try:
        state.result()
    except StageFailed as err:
        return any(f"exited with {status}" in str(err) for status in RETRYABLE)
    except Exception:  # noqa: BLE001 - anything else is not a preemption
        return False
    return False


def stage_task(stage: str):
    """``repro_stage`` with the retry policy for ``stage``."""
    if is_network_stage(stage):
        return repro_stage.with_options(retries=NETWORK_RETRIES, retry_delay_seconds=NETWORK_RETRY_DELAY_S)
    if stage.split("@", 1)[0] == "train":
        return repro_stage.with_options(
            retries=TRAIN_RETRIES, retry_delay_seconds=TRAIN_RETRY_DELAY_S, retry_condition_fn=_retryable_train_failure
        )
    return repro_stage


def _remote_command(root: str, *args: str, timeout_s: float = REMOTE_TIMEOUT_S) -> str:
    """``python -m flows.dvc_ops.remote ARGS`` in ``root``; its last output line (a failure raises)."""
    proc = subprocess.run(
        [sys.executable, "-m", "flows.dvc_ops.remote", *args], cwd=root, env=stage_env(), text=True,
        capture_output=True, stdin=subprocess.DEVNULL, timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"flows.dvc_ops.remote {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    lines = proc.stdout.strip().splitlines()
    return lines[-1] if lines else ""


_remote_retries = {
    "retries": REMOTE_RETRIES,
    "retry_delay_seconds": exponential_backoff(backoff_factor=10),
    "retry_jitter_factor": 0.5,
    "cache_policy": NO_CACHE,
}


@task(name="dvc-configure-remote", **_remote_retries)
def configure_remote(root: str) -> bool:
    """Set the DVC remote from params (``.dvc/config.local``); with a default remote (from params or
    set before), fetch its run-cache entries and return True."""
    logger = get_run_logger()
    result = _remote_command(root, "configure", timeout_s=120)
    if result == "none":
        logger.info("no DVC remote (storage.dvc_remote in params.yaml): stages are neither restored nor pushed")
        return False
    logger.info("DVC %s; run cache: %s", result, _remote_command(root, "sync-run-cache"))
    return True


@task(name="dvc-restore", task_run_name="restore {stage}", **_remote_retries)
def restore_stage(root: str, stage: str) -> str:
    """Outputs of ``stage`` from the remote when pushed for the same inputs: current / pulled / absent."""
    status = _remote_command(root, "restore", stage)
    get_run_logger().info("restore %s: %s", stage, status)
    return status


@task(name="dvc-push", task_run_name="push {stage}", **_remote_retries)
def push_stage(root: str, stage: str) -> str:
    """``dvc push --run-cache`` of ``stage`` plus its uncached outputs' objects."""
    result = _remote_command(root, "push", stage)
    get_run_logger().info("push %s: %s", stage, result)
    return result


def run_stage(root: str, stage: str, options: RunOptions, remote: bool) -> tuple[dict, str | None]:
    """Restore (with a remote, unless forced), repro and push one stage: its outcome and restore status."""
    force = stage == options.force_stage
    restore = restore_stage(root, stage) if remote and not force else None
    outcome = stage_task(stage)(root, stage, options.timeout_s, force)
    if remote and restore != "pulled":  # what was just pulled is on the remote already
        push_stage(root, stage)
    return outcome, restore


def run_row(root: str, row: StageRow, options: RunOptions, remote: bool, tracking: Tracking) -> dict:
    """Run ``row.stage`` and fill in its row (a failure marks it ``failed`` and raises); publish its artifact."""
    start = time.monotonic()
    try:
        outcome, restore = run_stage(root, row.stage, options, remote)
    except Exception:
        row.outcome, row.seconds = "failed", round(time.monotonic() - start, 2)
        raise
    row.outcome = "pulled" if restore == "pulled" else outcome["status"]
    row.seconds = round(time.monotonic() - start, 2)
    row.mlflow = stage_run_url(tracking, row.stage, root) or ""
    publish_stage_artifact(root, row.stage, outcome, restore, options.metrics_dir, row.mlflow or None)
    return outcome


def run_rows(root: str, target: str, rows: list[StageRow], options: RunOptions, remote: bool) -> list[dict]:
    """Each row's stage in order, the flow's progress artifact updated after each; the outcomes."""
    tracking = options.tracking or load_params(Path(root) / "params.yaml").tracking
    progress = create_progress_artifact(0.0, description=f"stages up to {target}")
    outcomes = []
    for i, row in enumerate(rows):
        outcomes.append(run_row(root, row, options, remote, tracking))
        update_progress_artifact(progress, 100.0 * (i + 1) / len(rows), description=f"{row.stage}: {row.outcome}")
    return outcomes


def run_stages(root: Path, target: str, stages: list[str], options: RunOptions | None = None) -> dict:
    """Run ``stages`` one after the other (a failure stops the flow); return a summary.

    ``ran`` / ``restored`` / ``skipped`` classify what ``dvc repro`` did; ``pulled`` lists the
    stages whose outputs came from the remote (they show up as restored or skipped too). The
    ``stages-<target>`` table artifact is published either way; a failure also publishes
    ``failure-<target>`` and is raised again.
    """
    options = options or RunOptions()
    logger = get_run_logger()
    logger.info("%d stage(s) up to %s in %s:\n  %s", len(stages), target, root, "\n  ".join(stages))
    if options.force_stage and options.force_stage not in stages:
        raise ValueError(f"force_stage {options.force_stage!r} is not among the stages to run: {stages}")
    summary: dict = {"root": str(root), "target": target, "stages": stages, "dry_run": options.dry_run}
    if options.dry_run:
        return summary
    start = time.monotonic()
    remote = options.use_remote and configure_remote(str(root))
    rows = [StageRow(stage) for stage in stages]
    try:
        outcomes = run_rows(str(root), target, rows, options, remote)
    except Exception as exc:
        publish_failure(target, rows, exc)
        raise
    publish_stage_table(target, rows)
    for status in ("ran", "restored", "skipped"):
        summary[status] = [o["stage"] for o in outcomes if o["status"] == status]
    summary["pulled"] = [r.stage for r in rows if r.outcome == "pulled"]
    summary["seconds"] = round(time.monotonic() - start, 1)
    logger.info(
        "done in %.1f s: %d ran, %d restored from run cache, %d skipped (unchanged); %d pulled from the remote",
        summary["seconds"], len(summary["ran"]), len(summary["restored"]), len(summary["skipped"]),
        len(summary["pulled"]),
    )
    return summary
