"""``make demo-controlnet``: the embedded demo plus a ControlNet phase (docs/CONTROL.md) — in its own workspace, so
``make demo`` keeps its DAG and time.

The workspace (``--out``, default ``.demo-controlnet/``) gets the DAG's code and ``params.yaml`` with
``configs/demo-controlnet/overlay.yaml`` merged on top; ``dvc repro eval_grid@phase10_canny`` runs there (the
corpus with its ``placed`` source, the models, phases 0-7, the conditions, the ControlNet phase and its eval).
``--seeds 0,1,2`` then retrains and re-evaluates the ControlNet phase under each further ``train.seed`` (the
stages called directly on a params copy: phases 0-7 stay seed 0's). ``--text-encoder-seed N`` builds the demo's
text encoder from seed N (``models.text_encoder_build.seed``: another draw, so the whole DAG is rebuilt; use its own
``--out``). Every run's figures are printed; the last line is ``RESULT name=demo_controlnet ...`` with each
figure's median over the seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from sdforge.config import parse_params
from sdforge.io import InputError
from tools.demo_recaption import write_workspace
from tools.preflight import stage_env
from tools.tiny_demo import merged

REPO = Path(__file__).resolve().parents[1]
OVERLAY = REPO / "configs" / "demo-controlnet" / "overlay.yaml"
PHASE = "phase10_canny"
WORKSPACE_MARKER = ".sdforge-demo-controlnet"
FIGURES = ("canny_f1", "canny_f1_base", "placement_iou", "placement_iou_base", "shape_agreement",
           "shape_agreement_base", "shape_agreement_decoded", "colour_agreement", "colour_agreement_base",
           "colour_agreement_decoded")  # fmt: skip


def make_workspace(out: Path, text_encoder_seed: int | None = None) -> dict[str, Any]:
    """``out`` with the DAG's code, the merged params and a DVC repo (kept if it exists: a rerun resumes); a
    ``text_encoder_seed`` replaces the demo text encoder's build seed (another draw)."""
    params = merged(yaml.safe_load((REPO / "params.yaml").read_text()), yaml.safe_load(OVERLAY.read_text()))
    if text_encoder_seed is not None:
        params["models"]["text_encoder_build"]["seed"] = text_encoder_seed
    return write_workspace(out, params, WORKSPACE_MARKER, "demo_controlnet workspace")


def run_seed(root: Path, params: dict[str, Any], seed: int) -> None:
    """Retrain and re-evaluate the ControlNet phase with ``train.seed`` ``seed`` (on a params copy)."""
    data = json.loads(json.dumps(params))
    data["train"]["seed"] = seed
    copy = root / f"params.seed{seed}.yaml"
    copy.write_text(yaml.safe_dump(data, sort_keys=False))
    for stage in ("train", "eval_grid"):
        cmd = [sys.executable, "-m", f"stages.{stage}", "--params", copy.name, "--item", PHASE]
        subprocess.run(cmd, cwd=root, env=stage_env(), check=True)


def figures(root: Path, params: dict[str, Any]) -> dict[str, float | None]:
    """The ControlNet phase's eval figures (``controlnet.*``), unprefixed."""
    metrics = json.loads((root / params["paths"]["metrics"] / "eval_grid" / f"{PHASE}.json").read_text())
    return {name: metrics.get(f"controlnet.{name}") for name in FIGURES}


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m tools.demo_controlnet [--out DIR] [--seeds 0,1,2] [--text-encoder-seed N]``."""
    parser = argparse.ArgumentParser(prog="python -m tools.demo_controlnet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".demo-controlnet", help="workspace (kept between runs)")
    parser.add_argument("--seeds", default="0", help="train.seed values of the ControlNet phase (the first: dvc's)")
    parser.add_argument("--text-encoder-seed", type=int, help="the demo text encoder's build seed (another draw)")
    args = parser.parse_args(argv)
    root, seeds = Path(args.out).resolve(), [int(s) for s in args.seeds.split(",")]
    try:
        params = make_workspace(root, args.text_encoder_seed)
    except InputError as err:
        print(err, file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rc = subprocess.run([sys.executable, "-m", "dvc", "repro", f"eval_grid@{PHASE}"], cwd=root,
                        env=stage_env()).returncode  # fmt: skip
    if rc != 0:
        print(f"dvc repro failed ({rc}); the stage logs above say why", file=sys.stderr)
        return rc
    runs = {params["train"]["seed"]: figures(root, params)}
    for seed in seeds:
        if seed not in runs:
            run_seed(root, params, seed)
            runs[seed] = figures(root, params)
    for seed, got in runs.items():
        print(f"train.seed {seed}: " + " ".join(f"{k}={v}" for k, v in got.items()))
    medians = {k: statistics.median(r[k] for r in runs.values()) for k in FIGURES if all(r[k] is not None
               for r in runs.values())}  # fmt: skip
    wall = time.perf_counter() - t0
    draw = parse_params(params).models.text_encoder_seed
    print(f"RESULT name=demo_controlnet seeds={len(runs)} text_encoder_seed={draw} wall_s={wall:.0f} "
          + " ".join(f"{k}={v:.3f}" for k, v in medians.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
