"""Flow ``data-prep``: every data stage (download → filter → fetch → encode latents), in order."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from prefect import flow

from flows.dvc_dag import all_stages, upstream_stages
from flows.tasks import run_stages

DATA_TARGET_STAGE = "encode_latents"
"""The data stages end with one ``encode_latents@<source>`` per source."""


@flow(name="data-prep")
def data_prep(dry_run: bool = False, stage_timeout_s: float | None = None) -> dict:
    """Run (or list) the stages upstream of every ``encode_latents@<source>``; root = working directory."""
    root = Path.cwd()
    targets = [s for s in all_stages(root) if s.split("@", 1)[0] == DATA_TARGET_STAGE]
    if not targets:
        raise ValueError(f"no {DATA_TARGET_STAGE}@<source> stage in {root / 'dvc.yaml'}")
    stages = upstream_stages(root, targets)
    return run_stages(root, ",".join(targets), stages, dry_run=dry_run, timeout_s=stage_timeout_s)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--stage-timeout-s", type=float, default=None)
    args = ap.parse_args(argv)
    print(json.dumps(data_prep(args.dry_run, args.stage_timeout_s), indent=2))


if __name__ == "__main__":
    main()
