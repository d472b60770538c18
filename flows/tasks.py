"""The Prefect tasks of the project and the loop that runs a stage list.

Per stage: restore its outputs from the DVC remote if they were pushed for the same inputs (a fresh
clone or pod), ``dvc repro --single-item`` it, push its outputs and run-cache entry, and publish a
markdown artifact with its metrics. The flow's progress is a progress artifact updated per stage.
Network work (downloads, restore, push) is retried with backoff; every subprocess has a timeout.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows.dvc_ops.runner import StageFailed, StageOutcome, kill_group, run_dvc_stage, stage_env
from sdforge.tracking import PARENT_TAG, STAGE_TAG

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


def _force_repro(root: str, stage: str, log_line, timeout_s: float | None) -> StageOutcome:
    """``dvc repro --force --single-item <stage>`` in its own session (flows/dvc_ops/runner.py has no --force)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dvc", "repro", "--force", "--single-item", stage],
        cwd=root, env=stage_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        text=True, errors="replace", start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except BaseException:
        kill_group(proc)
        raise
    for line in out.splitlines():  # str.splitlines also splits at a progress bar's \r
        log_line(line)
    if proc.returncode != 0:
        tail = "\n".join(out.splitlines()[-40:])
        raise StageFailed(f"dvc repro --force --single-item {stage} exited {proc.returncode}:\n{tail}")
    return StageOutcome(stage=stage, status="ran", seconds=round(time.monotonic() - start, 2))


def artifact_key(prefix: str, stage: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes: ``stage-train-phase1``."""
    return f"{prefix}-" + re.sub(r"[^a-z0-9]+", "-", stage.lower()).strip("-")


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
    if force:
        outcome = _force_repro(root, stage, log_line, timeout_s)
    else:
        outcome = run_dvc_stage(root, stage, log_line=log_line, timeout_s=timeout_s)
    logger.info("stage %s: %s in %.1f s", stage, outcome.status, outcome.seconds)
    return asdict(outcome)


def stage_task(stage: str):
    """``repro_stage`` with the retry policy for ``stage``."""
    if is_network_stage(stage):
        return repro_stage.with_options(retries=NETWORK_RETRIES, retry_delay_seconds=NETWORK_RETRY_DELAY_S)
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


def metrics_path(root: str | Path, metrics_dir: str, stage: str) -> Path:
    """``metrics/<stage>/<item>.json`` for ``stage@item``, ``metrics/<stage>.json`` otherwise."""
    name, _, item = stage.partition("@")
    return Path(root) / metrics_dir / (f"{name}/{item}.json" if item else f"{name}.json")


def mlflow_run_link(stage: str) -> str | None:
    """A link to the newest MLflow run of ``stage`` when the tracking URI is a server, else None.

    Data stages tag their run ``name@item``; phase stages tag it ``name`` under the phase's parent run.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        return None
    try:
        # lazy: mlflow (~2 s) only to find a stage run for its link
        import mlflow

        client = mlflow.MlflowClient(uri)
        experiments = [e.experiment_id for e in client.search_experiments()]
        name, _, item = stage.partition("@")
        filters = [f"tags.`{STAGE_TAG}` = '{stage}'"]
        if item:
            parents = client.search_runs(experiments, f"tags.`{PARENT_TAG}` = '{item}'")
            filters += [
                f"tags.`{STAGE_TAG}` = '{name}' and tags.`mlflow.parentRunId` = '{p.info.run_id}'" for p in parents
            ]
        runs = [
            r for f in filters
            for r in client.search_runs(experiments, f, order_by=["attributes.start_time DESC"], max_results=1)
        ]
    except Exception:  # noqa: BLE001 - a link is a convenience; the stage has finished either way
        return None
    if not runs:
        return None
    info = max(runs, key=lambda r: r.info.start_time).info
    return f"{uri.rstrip('/')}/#/experiments/{info.experiment_id}/runs/{info.run_id}"


def stage_markdown(stage: str, outcome: dict, restore: str | None, metrics: dict | None, link: str | None) -> str:
    rows = [f"### {stage}", "", f"**{outcome['status']}** in {outcome['seconds']:.1f} s"]
    if restore:
        rows[-1] += f" (remote: {restore})"
    if link:
        rows += ["", f"MLflow run: [{link}]({link})"]
    if metrics is None:
        rows += ["", "_no metrics file_"]
        return "\n".join(rows)
    rows += ["", "| metric | value |", "|---|---|"]
    for key, value in sorted(metrics.items()):
        text = json.dumps(value, default=str) if isinstance(value, dict | list) else str(value)
        rows.append(f"| {key} | {text.replace('|', '/')[:200]} |")
    return "\n".join(rows)


def publish_stage_artifact(root: str, stage: str, outcome: dict, restore: str | None, metrics_dir: str) -> None:
    """A markdown artifact (key ``stage-<name>-<item>``) with the stage's metrics JSON and MLflow link."""
    path = metrics_path(root, metrics_dir, stage)
    try:
        metrics = json.loads(path.read_text())
        metrics = metrics if isinstance(metrics, dict) else {"value": metrics}
    except (OSError, ValueError):
        metrics = None
    create_markdown_artifact(
        stage_markdown(stage, outcome, restore, metrics, mlflow_run_link(stage)),
        key=artifact_key("stage", stage), description=f"{stage}: {outcome['status']}",
    )


def run_stages(root: Path, target: str, stages: list[str], options: RunOptions | None = None) -> dict:
    """Run ``stages`` one after the other (a failure stops the flow); return a summary.

    ``ran`` / ``restored`` / ``skipped`` classify what ``dvc repro`` did; ``pulled`` lists the
    stages whose outputs came from the remote (they show up as restored or skipped too).
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
    progress = create_progress_artifact(0.0, description=f"stages up to {target}")
    remote = options.use_remote and configure_remote(str(root))
    outcomes, pulled = [], []
    for i, stage in enumerate(stages):
        force = stage == options.force_stage
        restore = restore_stage(str(root), stage) if remote and not force else None
        if restore == "pulled":
            pulled.append(stage)
        outcome = stage_task(stage)(str(root), stage, options.timeout_s, force)
        if remote and restore != "pulled":  # what was just pulled is on the remote already
            push_stage(str(root), stage)
        publish_stage_artifact(str(root), stage, outcome, restore, options.metrics_dir)
        outcomes.append(outcome)
        update_progress_artifact(progress, 100.0 * (i + 1) / len(stages), description=f"{stage}: {outcome['status']}")
    for status in ("ran", "restored", "skipped"):
        summary[status] = [o["stage"] for o in outcomes if o["status"] == status]
    summary["pulled"] = pulled
    summary["seconds"] = round(time.monotonic() - start, 1)
    logger.info(
        "done in %.1f s: %d ran, %d restored from run cache, %d skipped (unchanged); %d pulled from the remote",
        summary["seconds"], len(summary["ran"]), len(summary["restored"]), len(summary["skipped"]), len(pulled),
    )
    return summary
