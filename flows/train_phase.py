"""Flow ``train-phase``: every DVC stage up to one phase's eval grid, in order.

Run from the repo root (the deployments' pull step changes into it), e.g.::

    prefect deployment run 'train-phase/phase7' --watch      # through the stack (make stack-up)
    python -m flows.train_phase --phase phase2 --dry-run      # locally, no deployment
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prefect import flow

from flows.dvc_dag import upstream_stages
from flows.tasks import run_stages
from stages.config import load_params


def phase_target(phase: str) -> str:
    """The last stage of a phase."""
    return f"eval_grid@{phase}"


@flow(name="train-phase")
def train_phase(phase: str = "phase7", dry_run: bool = False, stage_timeout_s: float | None = None) -> dict:
    """Run (or with ``dry_run`` only list) the stages upstream of ``eval_grid@<phase>``.

    The project root is the working directory. DVC skips every stage that is up to date.
    """
    root = Path.cwd()
    phases = load_params(root / "params.yaml").phase_names()
    if phase not in phases:
        raise ValueError(f"phase must be one of {', '.join(phases)} (params.yaml phases); got {phase!r}")
    target = phase_target(phase)
    return run_stages(root, target, upstream_stages(root, target), dry_run=dry_run, timeout_s=stage_timeout_s)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", default="phase7")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--stage-timeout-s", type=float, default=None)
    args = ap.parse_args(argv)
    print(json.dumps(train_phase(args.phase, args.dry_run, args.stage_timeout_s), indent=2))


if __name__ == "__main__":
    main()
