"""Where the results of the pipeline are: the MLflow links a user opens first, the eval grid, the report.

    python -m tools.results              # the last phase in params.yaml
    python -m tools.results --phase phase3

Prints the MLflow UI link of the phase's parent run (params, headline metrics, eval grid, description), of
the ``report`` run and of the experiment's runs table; with a SQLite store the links point at
``tracking.ui_url`` (``make mlflow-ui`` serves the store there).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sdforge.config import load_params
from sdforge.tracking import experiment_url, flush_spool, newest_parent, run_url, tracking_uri, ui_base
from stages.report import REPORT


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--phase", default=None, help="default: the last phase")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    phase = args.phase or params.phase_names()[-1]
    cfg, uri = params.tracking, tracking_uri(params.tracking)
    grid = Path(params.paths.eval) / phase / "grid.png"
    report = Path(params.paths.eval) / REPORT

    flush_spool(cfg)  # the short stages' spooled runs first (sdforge.tracking_spool)
    # lazy: mlflow (~2 s) after the arguments are parsed
    import mlflow

    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(cfg.experiment)
    runs = {}
    if experiment is not None:
        runs = {name: newest_parent(client, experiment.experiment_id, name) for name in (phase, "report")}
    print(f"MLflow tracking URI: {uri}")
    if uri.startswith("sqlite:"):
        print(f"Open the UI: make mlflow-ui, then {ui_base(cfg)}")
    if experiment is not None:
        print(f"Experiment '{cfg.experiment}' (runs table): {experiment_url(cfg, experiment.experiment_id)}")
    for name, run in runs.items():
        link = run_url(cfg, run.info.experiment_id, run.info.run_id) if run else "none found"
        print(f"MLflow run '{name}': {link}")
    print(f"Eval grid: {grid}{'' if grid.exists() else '  (missing)'}")
    print(f"Cross-phase report (opens from disk): {report}{'' if report.exists() else '  (missing)'}")
    return 0 if runs.get(phase) and grid.exists() else 1


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    sys.exit(main())
