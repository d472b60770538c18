"""Stage ``report``: one page comparing every phase, after the last phase's eval grid.

Output ``${paths.eval}/report.html`` (self-contained: opens from disk, images inline): a table of each
phase's config and figures, the loss curves of all phases on one step axis, and per eval category that
category's images across phases (:mod:`sdforge.eval.report`). Also logged to MLflow: the child run
``report`` gets the page and each phase's figures as ``<phase>.<metric>``; its parent, the newest ``report``
run, gets the page, the loss chart and the category strips as artifacts. ``sdforge report`` builds the same
page outside DVC from whatever phases have finished.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from sdforge.config import Params
from sdforge.eval.report import Report, build_report
from sdforge.io import atomic_write_bytes, stage_cli
from sdforge.tracking import stage_run, summarise

log = logging.getLogger(__name__)

REPORT = "report.html"


def run(params: Params, out: Path) -> Report:
    """Build the report over ``params``' phases and write its page to ``out``."""
    report = build_report(
        f"sdforge report: experiment '{params.tracking.experiment}', {len(params.phases)} phases",
        {name: params.phases[name].model_dump() for name in params.phase_names()},
        list(params.eval.prompts),
        Path(params.paths.metrics),
        Path(params.paths.eval),
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out, report.page.encode())
    log.info("report of %d/%d phases: %s", report.phases_reported, report.phases, out.resolve())
    return report


def run_stage(params: Params, _item: None) -> dict:
    """Resolve the paths from ``params``, build the report, log it to MLflow; return its metrics."""
    out = Path(params.paths.eval) / REPORT
    report = run(params, out)
    metrics = {
        "phases": report.phases,
        "phases_reported": report.phases_reported,
        "images": len(report.images),
        "bytes": len(report.page.encode()),
    }
    with stage_run(params.tracking, "report", "report") as mlflow, tempfile.TemporaryDirectory() as tmp:
        mlflow.log_metrics({**metrics, **report.per_phase})
        mlflow.log_artifact(str(out))
        artifacts = [(out, None)]
        for name, data in report.images.items():
            path = Path(tmp) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            artifacts.append((path, path.parent.name if path.parent != Path(tmp) else None))
        note = f"**Report** of {report.phases_reported} of {report.phases} phases: open `{REPORT}` in Artifacts."
        summarise(mlflow, metrics=report.per_phase, note=note, artifacts=artifacts)
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.report --params params.yaml``."""
    stage_cli("report", run_stage, needs_item=False, argv=argv)


if __name__ == "__main__":
    main()
