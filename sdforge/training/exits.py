"""Exit statuses of the train stage that tell the orchestrator to retry (flows/tasks.py): the run's
checkpoints are good and a rerun resumes from the newest."""

import json
from pathlib import Path

PREEMPTED = 75
"""SIGTERM (pod deletion, spot notice): stopped at a step boundary, checkpointed if the grace allowed
(sysexits' EX_TEMPFAIL)."""
HUNG = 76
"""The hang watchdog fired: a step or collective made no progress for ``train.hang_timeout_s``."""
RETRYABLE = (PREEMPTED, HUNG)

MARKERS = {PREEMPTED: "PREEMPTED.json", HUNG: "HUNG.json"}
"""Written into the phase's run dir by the rank that stops so: the launcher (``stages.train`` running
torchrun, which itself only reports "a worker failed") turns them back into the status above."""


def write_marker(run_dir, status: int, info: dict) -> None:
    """Record why this process is about to exit with ``status`` (best effort: never raises)."""
    try:
        path = Path(run_dir) / MARKERS[status]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(info, default=str) + "\n")
    except OSError:
        pass


def read_marker(run_dir, since: float) -> tuple[int, dict] | None:
    """The status and record of a marker written at or after ``since`` (epoch seconds), if any."""
    for status, name in MARKERS.items():
        path = Path(run_dir) / name
        try:
            if path.stat().st_mtime >= since:
                return status, json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return None


def clear_markers(run_dir) -> None:
    for name in MARKERS.values():
        (Path(run_dir) / name).unlink(missing_ok=True)
