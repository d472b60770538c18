"""Benchmark: does the demo captioner read colour and shape back from demo images, for every train seed?

``python -m bench.demo_captioner [--quick] [--seeds 0 1 2] [--params params.yaml] [--steps N] [--batch B] [--lr LR]
[--width W] [--layers L] [--image-size S] [--off-palette F] [--eval-images N] [--threads T]``

For each seed: :func:`sdforge.demo.captioner.train_demo_captioner` trains a tiny BLIP on fresh renders of the
demo's shown combinations (as the pipeline fetches them: the ``demo.canvases`` in turn, 32 px on the shorter side,
JPEG), then :func:`~sdforge.demo.captioner.caption_accuracy` captions ``--eval-images`` fresh renders from another
random stream (the same images for every seed; every combination in balanced rounds, the held-out ones scored
apart) with ``load_captioner`` + ``generate`` (prompt ``""``, greedy, 12 new tokens). A caption not of the demo form
counts wrong on every field.

Baselines, not other implementations: chance (a uniform guess: 1/colours, 1/shapes) and the captions the recaptioned
demo source carries before recaptioning: camera file names such as ``DSC_01042.JPG`` (``demo.webdump``), scored the
same way (0: they name no colour or shape). The last line is ``RESULT name=demo_captioner ratio=<mean over seeds of
(colour + shape accuracy) / 2 on shown combinations ÷ the same for chance> ...`` with each seed's figures and train
seconds. ``--quick``: one seed, 300 steps, 150 images (under a minute).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
from pathlib import Path

import torch

from bench._common import load_average, machine, result_line
from sdforge.config import load_params
from sdforge.demo.captioner import OFF_PALETTE, caption_accuracy, eval_renders, score_captions, train_demo_captioner

REPO = Path(__file__).resolve().parents[1]
EVAL_SEED = 1000
"""Seed of the scored renders (its own stream: never a training draw), the same for every train seed."""


def file_name_scores(demo, n: int) -> dict:
    """:func:`score_captions` of file-name captions (``DSC_01000.JPG`` …, as the webdump source carries) for the
    ``n`` scored renders."""
    _, specs = eval_renders(demo, n, EVAL_SEED)
    return score_captions(demo, specs, [f"DSC_{1000 + i:05d}.JPG" for i in range(n)])


def run_seed(demo, args, seed: int) -> dict:
    """Train seed ``seed``'s captioner in a temporary folder and score it; the train metrics and the scores."""
    with tempfile.TemporaryDirectory(prefix="bench-demo-captioner-") as tmp:
        out = Path(tmp) / "captioner"
        train = train_demo_captioner(
            out, demo, steps=args.steps, batch_size=args.batch, lr=args.lr, width=args.width, layers=args.layers,
            image_size=args.image_size, seed=seed, off_palette=args.off_palette,
        )  # fmt: skip
        scores = caption_accuracy(out, demo, n=args.eval_images, seed=EVAL_SEED)
    return {**train, **scores}


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.demo_captioner", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seed 0 only, 300 steps, 150 images: under a minute")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--params", type=Path, default=REPO / "params.yaml", help="its demo section is drawn")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--width", type=int, default=96)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--image-size", type=int, default=32, help="the captioner's input side")
    ap.add_argument("--off-palette", type=float, default=OFF_PALETTE, help="share of each batch in other colours")
    ap.add_argument("--eval-images", type=int, default=600)
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.eval_images = [0], 300, 150
    return args


def _show(seed: int, r: dict) -> None:
    print(f"seed {seed}: train {r['seconds']:.1f} s ({r['cpu_seconds']:.1f} CPU-s), loss {r['loss_first']:.3f} -> "
          f"{r['loss_final']:.4f}; shown: colour {r['colour_accuracy']:.3f} shape {r['shape_accuracy']:.3f} "
          f"background {r['background_accuracy']:.3f}; held-out ({r['n_held_out']}): colour "
          f"{r['held_out_colour_accuracy']:.3f} shape {r['held_out_shape_accuracy']:.3f}; well-formed "
          f"{r['well_formed']:.3f}; e.g. {r['examples'][0][0]!r} -> {r['examples'][0][1]!r}")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    demo = load_params(args.params).demo
    load_before = load_average()
    print(f"machine: {machine()}; torch threads {torch.get_num_threads()}; load average {load_before}")
    runs = {}
    for seed in args.seeds:
        runs[seed] = run_seed(demo, args, seed)
        _show(seed, runs[seed])
    chance_colour, chance_shape = 1 / len(demo.colours), 1 / len(demo.shapes)
    chance = (chance_colour + chance_shape) / 2
    names = file_name_scores(demo, args.eval_images)
    names_acc = (names["colour_accuracy"] + names["shape_accuracy"]) / 2
    ours = statistics.mean((r["colour_accuracy"] + r["shape_accuracy"]) / 2 for r in runs.values())
    print(f"colour+shape accuracy (shown combinations), mean over seeds: ours {ours:.3f}; chance {chance:.3f} "
          f"(colour {chance_colour:.3f}, shape {chance_shape:.3f}); file-name captions {names_acc:.3f}")  # fmt: skip
    fields: dict[str, object] = {"ours_acc": ours, "chance_acc": chance, "file_name_acc": names_acc}
    for key in ("colour", "shape", "background", "held_out_colour", "held_out_shape"):
        fields[f"{key}_acc"] = statistics.mean(r[f"{key}_accuracy"] for r in runs.values())
    for seed, r in runs.items():
        fields[f"s{seed}_colour"], fields[f"s{seed}_shape"] = r["colour_accuracy"], r["shape_accuracy"]
        fields[f"s{seed}_ho_colour"], fields[f"s{seed}_ho_shape"] = (
            r["held_out_colour_accuracy"], r["held_out_shape_accuracy"])  # fmt: skip
        fields[f"s{seed}_train_s"] = r["seconds"]
    first = next(iter(runs.values()))
    fields |= {"train_s_max": max(r["seconds"] for r in runs.values()), "seeds": len(runs), "steps": args.steps,
               "batch": args.batch, "lr": args.lr, "width": args.width, "layers": args.layers,
               "image_size": args.image_size, "off_palette": args.off_palette, "params": first["params"],
               "eval_images": args.eval_images, "held_out_images": first["n_held_out"],
               "torch_threads": torch.get_num_threads(), "load_avg": f"{load_before} -> {load_average()}",
               "machine": machine()}  # fmt: skip
    print(result_line("demo_captioner", ours / chance, **fields))


if __name__ == "__main__":
    main()
