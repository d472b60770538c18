"""``make demo-sdxl``: a tiny SDXL-architecture base (``model/denoisers/sdxl.py``) built from scratch on the demo's
shapes, then taught the new colour word "orange" by each adapter setup of issue 60 — in its own workspace, so
``make demo`` keeps its DAG and time.

The workspace (``--out``, default ``.demo-sdxl/``) gets the DAG's code and ``params.yaml`` with
``configs/demo-sdxl/overlay.yaml`` merged on top, without :data:`DROPPED_PHASES`; ``dvc repro`` runs there (a
rerun resumes). ``--seeds 0,1,2`` then retrains and re-evaluates the adapter phases under each further
``train.seed`` (the stages called directly on a params copy; the base stays seed 0's). The last line is ``RESULT
name=demo_sdxl ...`` with each setup's orange and old-colour agreement per seed, trainable parameters and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from sdforge.io import InputError
from tools.demo_mmdit import demo_env
from tools.demo_recaption import REPO, write_workspace
from tools.tiny_demo import merged

OVERLAY = REPO / "configs" / "demo-sdxl" / "overlay.yaml"
WORKSPACE_MARKER = ".sdforge-demo-sdxl"
"""Written first into ``--out``: only a folder holding it is reused (its copy of the code replaced)."""
DROPPED_PHASES = ("phase2", "phase3", "phase4", "phase5", "phase6", "phase7", "phase9")
"""The base is phases 0-1 (a real fine-tune starts from SDXL base 1.0); LCM distillation: the family refuses it."""
SETUPS = {"phase8": "unet_attention", "phase8_te": "with_text_encoders", "phase8_nf4": "nf4_base"}
"""The adapter phases, by the issue's setups (a), (b), (c); those the overlay defines run."""


def sdxl_params() -> dict[str, Any]:
    """The demo's params with the overlay merged on top and :data:`DROPPED_PHASES` left out."""
    params = merged(yaml.safe_load((REPO / "params.yaml").read_text()), yaml.safe_load(OVERLAY.read_text()))
    params["phases"] = {k: v for k, v in params["phases"].items() if k not in DROPPED_PHASES}
    return params


def adapter_phases(params: dict[str, Any]) -> list[str]:
    """The adapter setups' phases the params define, in :data:`SETUPS` order."""
    return [p for p in SETUPS if p in params["phases"]]


def run_seed(root: Path, params: dict[str, Any], seed: int) -> None:
    """Retrain and re-evaluate the adapter phases with ``train.seed`` ``seed`` (on a params copy)."""
    data = json.loads(json.dumps(params))
    data["train"]["seed"] = seed
    copy = root / f"params.seed{seed}.yaml"
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    for phase in adapter_phases(params):
        for stage in ("train", "eval_grid"):
            cmd = [sys.executable, "-m", f"stages.{stage}", "--params", copy.name, "--item", phase]
            subprocess.run(cmd, cwd=root, env=demo_env(), check=True)


def figures(root: Path, params: dict[str, Any], seed: int) -> dict[str, Any]:
    """Each adapter phase's orange and old-colour agreement (of 16), trainable weights and peak RSS (MiB)."""
    metrics = Path(root / params["paths"]["metrics"])
    out: dict[str, Any] = {}
    for phase in adapter_phases(params):
        grid = json.loads((metrics / "eval_grid" / f"{phase}.json").read_text())
        trained = json.loads((metrics / "train" / f"{phase}.json").read_text())
        setup = SETUPS[phase]
        out[f"{setup}.seed{seed}.orange"] = round(16 * grid["colour_agreement_concept"])
        out[f"{setup}.seed{seed}.old_colours"] = round(16 * grid["colour_agreement_seen"])
        out[f"{setup}.trainable_params"] = trained["trainable_params"]
        out[f"{setup}.seed{seed}.peak_rss_mib"] = trained.get("memory.peak_rss_mib")
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m tools.demo_sdxl [--out DIR] [--seeds 0,1,2]``."""
    parser = argparse.ArgumentParser(prog="python -m tools.demo_sdxl", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".demo-sdxl", help="workspace (kept between runs)")
    parser.add_argument("--seeds", default="0", help="train seeds of the adapter phases (the first: dvc repro's)")
    args = parser.parse_args(argv)
    root = Path(args.out).resolve()
    try:
        params = write_workspace(root, sdxl_params(), WORKSPACE_MARKER, "demo_sdxl workspace")
    except InputError as err:
        print(err, file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rc = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, env=demo_env()).returncode
    if rc != 0:
        print(f"dvc repro failed ({rc}) after {time.perf_counter() - t0:.0f} s: see the stage logs", file=sys.stderr)
        return rc
    wall = time.perf_counter() - t0
    seeds = [int(s) for s in args.seeds.split(",")]
    out = figures(root, params, params["train"]["seed"])
    for seed in seeds[1:]:
        run_seed(root, params, seed)
        out.update(figures(root, params, seed))
    print(f"MLflow: make mlflow-ui in {root}; report: {root / params['paths']['eval'] / 'report.html'}")
    print(f"RESULT name=demo_sdxl wall_s={wall:.0f} " + " ".join(f"{k}={v}" for k, v in out.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
