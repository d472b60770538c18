"""``make demo-mmdit``: the embedded demo's whole DAG with the MM-DiT family instead of the UNet — a tiny SD3
transformer (``model/denoisers/mmdit.py``) under two tiny CLIP encoders, from scratch, phases 0–8 — in its own
workspace, so ``make demo`` keeps its DAG and time.

The workspace (``--out``, default ``.demo-mmdit/``) gets the DAG's code and ``params.yaml`` with
``configs/demo-mmdit/overlay.yaml`` merged on top, without the phases the family refuses (:data:`DROPPED_PHASES`);
``dvc repro`` runs there (a rerun resumes). Last line: ``RESULT name=demo_mmdit wall_s=… `` with phase 7's and
phase 8's probe scores from their eval grids.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from sdforge.io import InputError
from tools.demo_recaption import REPO, write_workspace
from tools.preflight import stage_env
from tools.tiny_demo import merged

OVERLAY = REPO / "configs" / "demo-mmdit" / "overlay.yaml"
WORKSPACE_MARKER = ".sdforge-demo-mmdit"
"""Written first into ``--out``: only a folder holding it is reused (its copy of the code replaced)."""
DROPPED_PHASES = ("phase9",)
"""LCM distillation: the mmdit family refuses ``distill`` (docs/MMDIT.md)."""


def mmdit_params() -> dict[str, Any]:
    """The demo's params with the overlay merged on top and :data:`DROPPED_PHASES` left out."""
    params = merged(yaml.safe_load((REPO / "params.yaml").read_text()), yaml.safe_load(OVERLAY.read_text()))
    params["phases"] = {k: v for k, v in params["phases"].items() if k not in DROPPED_PHASES}
    return params


def demo_env() -> dict[str, str]:
    """The stages' environment (:func:`tools.preflight.stage_env`) without the preflight's 1-MiB malloc threshold
    (unless the caller set one): it trades speed for a lower peak RSS, and the MM-DiT's 2-MiB activations then
    page-fault at every step — phase 1 trained at 2.0 steps/s with it, ~4.6 without (2026-11-28, this machine)."""
    env = stage_env()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    return env


def scores(root: Path, params: dict[str, Any]) -> dict[str, Any]:
    """Probe scores of every phase whose eval grid ran (``metrics/eval_grid/<phase>.json``), flattened."""
    out: dict[str, Any] = {}
    for path in sorted((root / params["paths"]["metrics"] / "eval_grid").glob("*.json")):
        figures = json.loads(path.read_text())
        out.update({f"{path.stem}.{k}": v for k, v in figures.items()
                    if "_agreement_" in k and isinstance(v, int | float)})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m tools.demo_mmdit [--out DIR] [--target STAGE]``."""
    parser = argparse.ArgumentParser(prog="python -m tools.demo_mmdit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".demo-mmdit", help="workspace (kept between runs)")
    parser.add_argument("--target", default=None, help="the stage dvc repro runs up to (default: the whole DAG)")
    args = parser.parse_args(argv)
    root = Path(args.out).resolve()
    try:
        params = write_workspace(root, mmdit_params(), WORKSPACE_MARKER, "demo_mmdit workspace")
    except InputError as err:
        print(err, file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "dvc", "repro", *([args.target] if args.target else [])]
    rc = subprocess.run(cmd, cwd=root, env=demo_env()).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        print(f"dvc repro failed ({rc}) after {wall:.0f} s; the stage logs above say why", file=sys.stderr)
        return rc
    figures = " ".join(f"{k}={v}" for k, v in scores(root, params).items())
    print(f"MLflow: make mlflow-ui in {root}; report: {root / params['paths']['eval'] / 'report.html'}")
    print(f"RESULT name=demo_mmdit wall_s={wall:.0f} {figures}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
