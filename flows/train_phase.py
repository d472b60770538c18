"""Flow ``train-phase``: every DVC stage up to one phase's eval grid, in order; the last phase's flow
ends with the cross-phase ``report`` stage.

Run from the repo root (the deployments' pull step changes into it), e.g.::

    prefect deployment run 'train-phase/phase7' --watch      # through the stack (make stack-up)
    prefect deployment run 'train-phase/phase7' -p force_stage=eval_grid@phase7
    python -m flows.train_phase --phase phase2 --dry-run      # locally, no deployment

With a DVC remote (``storage.dvc_remote`` in params.yaml) each stage is first restored from it (a
fresh clone pulls what was pushed instead of recomputing it) and pushed after it ran.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml
from prefect import flow

from flows.dvc_ops.dag import upstream_stages
from flows.tasks import RunOptions, run_stages
from sdforge.config import Params, load_params

REPORT_STAGE = "report"
"""The cross-phase report (stages/report.py): run after the last phase's eval grid."""


def phase_target(phase: str) -> str:
    """The last stage of a phase."""
    return f"eval_grid@{phase}"


def flow_targets(root: Path, params: Params, phase: str) -> list[str]:
    """The phase's eval grid, and for the last phase also the report (when ``dvc.yaml`` defines it)."""
    targets = [phase_target(phase)]
    stages = (yaml.safe_load((root / "dvc.yaml").read_text()) or {}).get("stages", {})
    if phase == params.phase_names()[-1] and REPORT_STAGE in stages:
        targets.append(REPORT_STAGE)
    return targets


def run_options(
    params: Params, dry_run: bool, stage_timeout_s: float | None, force_stage: str | None, use_remote: bool
) -> RunOptions:
    return RunOptions(
        dry_run=dry_run,
        timeout_s=stage_timeout_s,
        force_stage=force_stage or None,
        use_remote=use_remote,
        metrics_dir=params.paths.metrics,
    )


def checked_phase(params: Params, phase: str) -> str:
    phases = params.phase_names()
    if phase not in phases:
        raise ValueError(f"phase must be one of {', '.join(phases)} (params.yaml phases); got {phase!r}")
    return phase


@flow(name="train-phase")
def train_phase(
    phase: str = "phase7",
    dry_run: bool = False,
    stage_timeout_s: float | None = None,
    force_stage: str | None = None,
    use_remote: bool = True,
) -> dict:
    """Run (or with ``dry_run`` only list) the stages upstream of ``eval_grid@<phase>`` (and of ``report``
    for the last phase).

    The project root is the working directory. DVC skips every stage that is up to date;
    ``force_stage`` (e.g. ``train@phase1``) reruns that one stage regardless.
    """
    return run_phase(phase, dry_run, stage_timeout_s, force_stage, use_remote)


def run_phase(
    phase: str, dry_run: bool, stage_timeout_s: float | None, force_stage: str | None, use_remote: bool
) -> dict:
    """The stages up to ``eval_grid@<phase>`` (and ``report`` after the last phase) in the working directory
    (the body of both phase flows)."""
    root = Path.cwd()
    params = load_params(root / "params.yaml")
    targets = flow_targets(root, params, checked_phase(params, phase))
    options = run_options(params, dry_run, stage_timeout_s, force_stage, use_remote)
    return run_stages(root, " + ".join(targets), upstream_stages(root, targets), options)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", default="phase7")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--stage-timeout-s", type=float, default=None)
    ap.add_argument("--force-stage", default=None, help="rerun this stage with dvc repro --force")
    ap.add_argument("--no-remote", action="store_true", help="neither restore from nor push to storage.dvc_remote")
    args = ap.parse_args(argv)
    summary = train_phase(args.phase, args.dry_run, args.stage_timeout_s, args.force_stage, not args.no_remote)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
