"""``make demo-recaption``: the embedded demo plus a source captioned with file names, recaptioned by the demo's
captioner — in its own workspace, so ``make demo`` keeps its DAG and time.

The workspace (``--out``, default ``.demo-recaption/``) gets the DAG's code and ``params.yaml`` with
``configs/demo-recaption/overlay.yaml`` merged on top; ``dvc repro`` runs there up to ``--target`` (default
``encode_latents@webdump``: the corpus, the models with the captioner, the captions, their token ids;
``--all``: the whole DAG, phase 6 training with half of webdump's samples on synthetic captions). Then it scores
the synthetic captions against the captions the images should have (the corpus's ``truth.json``): how often
their colour, shape and background words are right. Last line: ``RESULT name=demo_recaption ...``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from sdforge.config import parse_params
from sdforge.demo.captioner import score_captions
from sdforge.demo.corpus import WEBDUMP_DIR, WEBDUMP_TRUTH
from sdforge.demo.shapes import parse_caption
from sdforge.io import InputError
from sdforge.output_dirs import check_scratch_dir, mark_scratch_dir
from tools.preflight import COPIED, stage_env
from tools.tiny_demo import RECAPTION_OVERLAY, merged

REPO = Path(__file__).resolve().parents[1]
SOURCE = "webdump"
WORKSPACE_MARKER = ".sdforge-demo-recaption"
"""Written first into ``--out``: only a folder holding it is reused (its copy of the code replaced)."""


def make_workspace(out: Path) -> dict[str, Any]:
    """``out`` with the DAG's code, the merged params and a DVC repo without git (kept if it exists: a rerun
    resumes where the last one stopped); returns the params. ``out`` must be new, empty or this tool's workspace
    (its :data:`WORKSPACE_MARKER`); never the project or a folder around it (an :class:`InputError`)."""
    params = merged(yaml.safe_load((REPO / "params.yaml").read_text()), yaml.safe_load(RECAPTION_OVERLAY.read_text()))
    return write_workspace(out, params, WORKSPACE_MARKER, "demo_recaption workspace")


def write_workspace(out: Path, params: dict[str, Any], marker: str, label: str) -> dict[str, Any]:
    """``out`` (new, empty, or holding ``marker``) with the DAG's code, ``params`` as its ``params.yaml`` and a DVC
    repo without git (kept if it exists); returns ``params``."""
    check_scratch_dir(out, marker, label, REPO, COPIED)
    mark_scratch_dir(out, marker, label)
    for name in COPIED:
        src, dst = REPO / name, out / name
        if src.is_dir():
            shutil.rmtree(dst, ignore_errors=True)  # our workspace's copy of the code, replaced by the repo's
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif src.is_file():
            dst.write_bytes(src.read_bytes())
    (out / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if not (out / ".dvc").is_dir():
        subprocess.run([sys.executable, "-m", "dvc", "init", "--no-scm", "-q"], cwd=out, check=True, env=stage_env())
    return params


def score(root: Path, params: dict[str, Any]) -> dict[str, Any]:
    """The synthetic captions of ``root``'s webdump source against the truth (:func:`score_captions`): share of
    right colour, shape and background words, how many were kept as file names (rejected), and a few examples."""
    truth = json.loads((root / params["paths"]["demo_source"] / WEBDUMP_DIR / WEBDUMP_TRUTH).read_text())
    folder = root / params["paths"]["captions"] / SOURCE
    rows = [r for path in sorted(folder.glob("*.parquet")) for r in pq.read_table(path).to_pylist()]
    specs = [parse_caption(truth[r["original_caption"]]) for r in rows]
    got = score_captions(parse_params(params).demo, specs, [r["synthetic_caption"] for r in rows])
    return {
        "images": len(rows),
        **{f"{field}_right": round(got[f"{field}_accuracy"] or 0.0, 4) for field in ("colour", "shape", "background")},
        "kept_original": sum(1 for r in rows if r["rejected"]),
        "examples": [(r["original_caption"], r["synthetic_caption"]) for r in rows[:5]],
    }


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m tools.demo_recaption [--out DIR] [--target STAGE | --all]``."""
    parser = argparse.ArgumentParser(prog="python -m tools.demo_recaption", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".demo-recaption", help="workspace (kept between runs)")
    parser.add_argument("--target", default=f"encode_latents@{SOURCE}", help="the stage dvc repro runs up to")
    parser.add_argument("--all", action="store_true", help="the whole DAG (phase 6 trains on the captions)")
    args = parser.parse_args(argv)
    root = Path(args.out).resolve()
    try:
        params = make_workspace(root)
    except InputError as err:
        print(err, file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "dvc", "repro", *([] if args.all else [args.target])]
    rc = subprocess.run(cmd, cwd=root, env=stage_env()).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        print(f"dvc repro failed ({rc}) after {wall:.0f} s; the stage logs above say why", file=sys.stderr)
        return rc
    got = score(root, params)
    for original, synthetic in got.pop("examples"):
        print(f"  {original:>16} → {synthetic}")
    captions = json.loads((root / params["paths"]["metrics"] / "caption_images" / f"{SOURCE}.json").read_text())
    print(f"captions: {captions['images']} images, {captions['synthetic']} synthetic, MLflow: make mlflow-ui in {root}")
    figures = " ".join(f"{k}={v}" for k, v in got.items())
    print(f"RESULT name=demo_recaption wall_s={wall:.0f} {figures}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
