"""Where the results of the pipeline are: MLflow tracking URI, the last phase's run, its eval grid.

    python -m tools.report              # the last phase in params.yaml
    python -m tools.report --phase phase3
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from sdforge.config import load_params
from sdforge.tracking import PARENT_TAG, tracking_uri

UI_HOST, UI_PORT = "127.0.0.1", 5000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--phase", default=None, help="default: the last phase")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    phase = args.phase or params.phase_names()[-1]
    uri = tracking_uri(params.tracking)
    grid = Path(params.paths.eval) / phase / "grid.png"

    # lazy: mlflow (~2 s) after the arguments are parsed
    import mlflow

    mlflow.set_tracking_uri(uri)
    client = mlflow.MlflowClient()
    experiment = client.get_experiment_by_name(params.tracking.experiment)
    runs = []
    if experiment is not None:
        runs = client.search_runs(
            [experiment.experiment_id],
            filter_string=f"tags.`{PARENT_TAG}` = '{phase}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
    print(f"MLflow tracking URI: {uri}")
    if runs:
        run = runs[0]
        print(f"MLflow run for {phase}: {run.info.run_id} (experiment '{params.tracking.experiment}', "
              f"id {experiment.experiment_id})")
    else:
        print(f"MLflow run for {phase}: none found in experiment '{params.tracking.experiment}'")
    print(f"Eval grid: {grid}{'' if grid.exists() else '  (missing)'}")
    if uri.startswith("sqlite:"):
        link = f"http://{UI_HOST}:{UI_PORT}"
        if runs:
            link += f"/#/experiments/{experiment.experiment_id}/runs/{runs[0].info.run_id}"
        print(f"Open the UI: make mlflow-ui, then {link}")
    else:
        print(f"Open the UI: {uri}")
    return 0 if runs and grid.exists() else 1


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    sys.exit(main())
