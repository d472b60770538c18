"""The one Prefect task of the project (run one DVC stage) and the loop that runs a stage list."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from flows.dvc_runner import run_dvc_stage

NETWORK_STAGE_PREFIXES = ("download_metadata", "fetch_images")
"""Stages that talk to the network: a failure there is often transient, so they are retried."""
NETWORK_RETRIES = 2
NETWORK_RETRY_DELAY_S = [30, 120]


def is_network_stage(stage: str) -> bool:
    return stage.split("@", 1)[0] in NETWORK_STAGE_PREFIXES


# DVC is the cache (it skips a stage whose deps, params and outs are unchanged): no Prefect caching.
@task(name="dvc-stage", task_run_name="{stage}", retries=0, cache_policy=NO_CACHE)
def repro_stage(root: str, stage: str, timeout_s: float | None = None) -> dict:
    """``dvc repro --single-item <stage>``; the output goes to the Prefect log."""
    logger = get_run_logger()
    outcome = run_dvc_stage(root, stage, log_line=logger.info, timeout_s=timeout_s)
    logger.info("stage %s: %s in %.1f s", stage, outcome.status, outcome.seconds)
    return asdict(outcome)


def stage_task(stage: str):
    """``repro_stage`` with the retry policy for ``stage``."""
    if is_network_stage(stage):
        return repro_stage.with_options(retries=NETWORK_RETRIES, retry_delay_seconds=NETWORK_RETRY_DELAY_S)
    return repro_stage


def run_stages(
    root: Path, target: str, stages: list[str], *, dry_run: bool, timeout_s: float | None
) -> dict:
    """Run ``stages`` one after the other (a failure stops the flow); return a summary."""
    logger = get_run_logger()
    logger.info("%d stage(s) up to %s in %s:\n  %s", len(stages), target, root, "\n  ".join(stages))
    summary: dict = {"root": str(root), "target": target, "stages": stages, "dry_run": dry_run}
    if dry_run:
        return summary
    start = time.monotonic()
    outcomes = [stage_task(s)(str(root), s, timeout_s) for s in stages]
    for status in ("ran", "restored", "skipped"):
        summary[status] = [o["stage"] for o in outcomes if o["status"] == status]
    summary["seconds"] = round(time.monotonic() - start, 1)
    logger.info(
        "done in %.1f s: %d ran, %d restored from run cache, %d skipped (unchanged)",
        summary["seconds"], len(summary["ran"]), len(summary["restored"]), len(summary["skipped"]),
    )
    return summary
