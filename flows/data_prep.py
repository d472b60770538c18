"""Flow ``data-prep``: every data stage (download → filter → fetch → encode latents), in order."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prefect import flow

from flows.dvc_ops.dag import all_stages, upstream_stages
from flows.tasks import run_stages
from flows.train_phase import run_options
from sdforge.config import load_params

DATA_TARGET_STAGE = "encode_latents"
"""The data stages end with one ``encode_latents@<source>`` per source."""


@flow(name="data-prep")
def data_prep(
    dry_run: bool = False,
    stage_timeout_s: float | None = None,
    force_stage: str | None = None,
    use_remote: bool = True,
) -> dict:
    """Run (or list) the stages upstream of every ``encode_latents@<source>``; root = working directory."""
    root = Path.cwd()
    targets = [s for s in all_stages(root) if s.split("@", 1)[0] == DATA_TARGET_STAGE]
    if not targets:
        raise ValueError(f"no {DATA_TARGET_STAGE}@<source> stage in {root / 'dvc.yaml'}")
    options = run_options(load_params(root / "params.yaml"), dry_run, stage_timeout_s, force_stage, use_remote)
    return run_stages(root, ",".join(targets), upstream_stages(root, targets), options)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--stage-timeout-s", type=float, default=None)
    ap.add_argument("--force-stage", default=None)
    ap.add_argument("--no-remote", action="store_true")
    args = ap.parse_args(argv)
    print(json.dumps(data_prep(args.dry_run, args.stage_timeout_s, args.force_stage, not args.no_remote), indent=2))


if __name__ == "__main__":
    main()
