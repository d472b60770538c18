"""``sdforge`` — user-facing commands: ``generate`` samples images from a phase checkpoint, ``export`` writes
it as a diffusers ``StableDiffusionPipeline`` folder (optionally registered in MLflow), ``report`` writes the
cross-phase report (``eval/report.html``), ``runs`` lists or removes the run dirs the train stage moved aside
because a phase's inputs changed, ``preflight`` runs the full configuration's whole DAG on a small
sample and forecasts the full run (docs/PREFLIGHT.md)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

# Only argparse, the typed config and sdforge.io at the top: `sdforge --help` and a refused flag answer in well
# under a second. Each command imports what it runs (torch, diffusers, MLflow: ~8 s and ~600 MB) inside itself.
from sdforge.config import ConfigError, load_params
from sdforge.config.arguments import (
    MAX_SIZE_FACTOR,
    EvaluateArguments,
    GenerateArguments,
    RunsArguments,
    check_arguments,
    check_image_size,
)
from sdforge.eval.export_target import EXPORT_MARKER, check_export_target
from sdforge.io import InputError, setup_logging, write_json

log = logging.getLogger("sdforge")


def _generate(args: argparse.Namespace) -> int:
    """``sdforge generate``: the flags are validated (:class:`GenerateArguments`, one line naming a bad one) before
    any model is loaded; the image size against the loaded model (:func:`check_image_size`) before sampling."""
    flags = check_arguments(GenerateArguments, args)
    params = load_params(args.params)
    checkpoint = _checkpoint(args, params)
    # lazy, as every command's own imports here: torch, diffusers (see the imports at the top)
    from model.sampler import latent_shape_for
    from sdforge.eval.sampling import generate, load_pipeline, max_steps, trained_side

    if args.category is not None and args.category not in params.eval.prompts:
        log.error("--category %s: not an eval category %s", args.category, list(params.eval.prompts))
        return 2
    pipe = load_pipeline(
        Path(params.paths.models), checkpoint, use_ema=not args.live, device=args.device, fuse_adapter=args.fuse_lora
    )
    default_steps, default_guidance = _sampling_defaults(args, params, pipe)
    steps = flags.steps or default_steps
    guidance = flags.guidance if flags.guidance is not None else default_guidance
    check_image_size(flags.width, flags.height, trained_side(pipe))
    try:
        latent_shape_for(pipe.unet, pipe.vae, width=flags.width, height=flags.height)
    except ValueError as err:
        log.error("--width/--height: %s", err)
        return 2
    limit = max_steps(pipe)
    if limit is not None and steps > limit:
        log.error(
            "--steps %d: this distilled phase samples at most %d steps (distill.num_ddim_timesteps)", steps, limit
        )
        return 2
    prompts = [p for p in flags.prompt for _ in range(flags.num_images)]
    seeds = flags.seeds
    _refuse_foreign_files(_png_paths(flags.out, seeds))
    controls = _control_images(flags.control_per_image)
    if not _controls_fit(pipe, controls, len(prompts), flags):
        return 2
    images = generate(
        pipe,
        prompts,
        negative_prompt=args.negative,
        steps=steps,
        guidance_scale=guidance,
        seeds=seeds,
        batch_size=flags.batch_size,
        width=flags.width,
        height=flags.height,
        control_images=controls,
    )
    meta = {
        "negative_prompt": args.negative,
        "steps": steps,
        "guidance_scale": guidance,
        "checkpoint": str(checkpoint),
        "checkpoint_hash": pipe.checkpoint_hash,
        "weights": "live" if args.live else "ema",
    }
    for path in _write_pngs(flags.out, images, prompts, seeds, meta):
        print(path)
    return 0


def _controls_fit(pipe, controls, count: int, flags) -> bool:
    """Whether the conditioning images suit the checkpoint (a ControlNet phase needs them, of the image size; any
    other refuses them); logs why not."""
    from model.sampler import latent_shape_for  # lazy: torch (imported already by _generate)
    from sdforge.eval.sampling import control_tensors  # lazy: torch, as above

    try:
        control_tensors(pipe, controls, count, latent_shape_for(pipe.unet, pipe.vae, width=flags.width,
                                                                height=flags.height))  # fmt: skip
    except ValueError as err:
        log.error("--control-image: %s", err)
        return False
    return True


def _control_images(paths: list[Path]):
    """The ``--control-image`` files as RGB uint8 arrays (decoded within the project's pixel bound), None without
    any; an InputError naming a file that does not decode."""
    if not paths:
        return None
    import numpy as np  # lazy: only generate reads images

    from sdforge.bounds.images import ImageRejected, open_bounded  # lazy: PIL, only generate reads images

    decoded = {}
    for path in dict.fromkeys(paths):
        try:
            decoded[path] = np.asarray(open_bounded(path))
        except (OSError, ImageRejected) as err:
            raise InputError(f"--control-image {path}: not an image this can read ({err})") from None
    return [decoded[path] for path in paths]


def _write_pngs(out: Path, images, prompts: list[str], seeds: list[int], meta: dict) -> list[Path]:
    """Each image as ``out/NNN-seedS.png`` with its prompt, seed and ``meta`` in ``sdforge:*`` text chunks."""
    from PIL import Image, PngImagePlugin  # lazy: only generate writes images

    out.mkdir(parents=True, exist_ok=True)
    paths = _png_paths(out, seeds)
    for img, prompt, seed, path in zip(images, prompts, seeds, paths, strict=True):
        info = PngImagePlugin.PngInfo()
        chunks = {"prompt": prompt, "negative_prompt": meta["negative_prompt"], "seed": seed, **meta}  # their order
        for k, v in chunks.items():
            info.add_text(f"sdforge:{k}", str(v))
        Image.fromarray(img).save(path, pnginfo=info)
    return paths


def _png_paths(out: Path, seeds: list[int]) -> list[Path]:
    """Where image ``i`` goes: ``out/NNN-seedS.png``."""
    return [out / f"{i:03d}-seed{seed}.png" for i, seed in enumerate(seeds)]


def _refuse_foreign_files(paths: list[Path]) -> None:
    """An :class:`InputError` when one of ``paths`` exists and is not an image ``sdforge generate`` wrote (a PNG
    with its ``sdforge:prompt`` chunk): generate replaces its own earlier images, never a user's file."""
    from PIL import Image, UnidentifiedImageError  # lazy: only generate writes images

    for path in paths:
        if not path.exists() and not path.is_symlink():
            continue
        try:
            with Image.open(path) as img:
                ours = path.is_file() and not path.is_symlink() and "sdforge:prompt" in getattr(img, "text", {})
        except (OSError, UnidentifiedImageError):
            ours = False
        if not ours:
            raise InputError(
                f"{path}: exists and is not an image sdforge generate wrote; pick another --out (nothing written)"
            )


def _sampling_defaults(args: argparse.Namespace, params, pipe) -> tuple[int, float]:
    """Steps and guidance when ``--steps`` / ``--guidance`` are not given: a distilled phase's few-step settings
    (``distill.sampling_steps``, 1.0), else ``--category``'s, else ``eval.steps`` / ``eval.guidance_scale``."""
    from sdforge.eval.sampling import few_step_settings  # lazy: torch (imported already by _generate)

    few = few_step_settings(pipe)
    if few is not None:
        return few
    return params.eval.settings(args.category) if args.category else (params.eval.steps, params.eval.guidance_scale)


def _checkpoint(args: argparse.Namespace, params) -> Path:
    """``--checkpoint``, or the last phase's checkpoint folder."""
    return Path(args.checkpoint or Path(params.paths.checkpoints) / params.phase_names()[-1])


def _export(args: argparse.Namespace) -> int:
    """``sdforge export``: refuse an ``--out`` in the workspace's folders (or one that contains it) before loading
    anything; the export itself refuses a non-empty ``--out`` that is not a previous export (docs/EVAL.md)."""
    params = load_params(args.params)
    checkpoint, out = _checkpoint(args, params), Path(args.out)
    check_export_target(out, params, Path(args.params), checkpoint, args.overwrite)  # before the heavy imports
    from sdforge.eval.export import export_pipeline, register  # lazy: diffusers

    metrics = export_pipeline(
        Path(params.paths.models), checkpoint, out, not args.live, keep_lora=args.lora_file, overwrite=args.overwrite
    )
    if args.mlflow_register:
        metrics.update(register(out, args.mlflow_register, params.tracking, metrics))
        write_json(out / EXPORT_MARKER, metrics)  # the export's own marker, now with the model version
    print(args.out)
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    """``sdforge evaluate --protocol coco``: FID and CLIP score on COCO-2014 val captions (docs/EVAL.md)."""
    flags = check_arguments(EvaluateArguments, args)
    params = load_params(args.params)
    phase = flags.phase or params.phase_names()[-1]
    checkpoint = Path(args.checkpoint or Path(params.paths.checkpoints) / phase)
    samples = flags.samples or params.eval.coco.samples
    out = flags.out or Path(params.paths.evaluations) / phase / f"{args.protocol}-{samples}"
    from sdforge.eval.coco import run_protocol  # lazy: torch, diffusers

    metrics = run_protocol(params, checkpoint, samples, out, args.device, use_ema=not args.live)
    print(json.dumps(metrics, indent=2))
    print(out / "coco.json")
    return 0


def _report(args: argparse.Namespace) -> int:
    """The cross-phase report over the phases that have finished (``stages.report``, outside DVC)."""
    params = load_params(args.params)
    from stages import report as report_stage  # lazy: matplotlib, MLflow

    out = Path(params.paths.eval) / report_stage.REPORT
    if args.mlflow:
        report_stage.run_stage(params, None)
    else:
        report_stage.run(params, out)
    print(out)
    return 0


def _tracking_flush(args: argparse.Namespace) -> int:
    """Replay the MLflow runs short stages spooled (``tracking.spool``) into the store now."""
    from sdforge.tracking import flush_spool  # lazy: MLflow

    replayed = flush_spool(load_params(args.params).tracking)
    print(f"{replayed} spooled MLflow run(s) logged")
    return 0


def _runs(args: argparse.Namespace) -> int:
    """List the run dirs the train stage moved aside (their size), or remove them (``clean --yes``)."""
    check_arguments(RunsArguments, args)
    runs = Path(load_params(args.params).paths.runs)
    from sdforge.training.run_dir import remove_stale, stale_runs  # lazy: torch

    found = stale_runs(runs, args.phase)
    for stale in found:
        print(f"{stale.path}\t{stale.bytes / 1e6:.1f} MB\t{_stale_note(stale.path)}")
    print(f"{len(found)} stale run(s), {sum(s.bytes for s in found) / 1e6:.1f} MB")
    if args.action == "clean" and found:
        if not args.yes:
            print("nothing removed: rerun with --yes to delete these folders")
            return 1
        remove_stale(runs, args.phase)
        print(f"removed {len(found)} stale run(s)")
    return 0


def _stale_note(path: Path) -> str:
    """What differed, from the folder's note (empty if it has none)."""
    from sdforge.training.run_dir import STALE_NOTE  # lazy: torch (runs only)

    try:
        note = json.loads((path / STALE_NOTE).read_text())
    except (OSError, ValueError):
        return ""
    remote = f"; remote copies: {note['remote']}" if note.get("remote") else ""
    return f"moved {note.get('moved_at', '?')}: {', '.join(note.get('differs', []))}{remote}"


def _check(args: argparse.Namespace) -> int:
    """``sdforge check``: params.yaml validated as ``dvc repro`` will read it (``tools.check_params``)."""
    from tools.check_params import check  # lazy: DVC's YAML loader

    return check(args.params)


def build_parser() -> argparse.ArgumentParser:
    """The ``sdforge`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="sdforge",
        description="Sample, export and evaluate the phases a pipeline run trained (`make demo` / `dvc repro` train "
        "them); check params.yaml; rehearse the full configuration (preflight).",
        epilog="examples:\n"
        '  sdforge generate --prompt "a red circle on a white background" --num-images 4\n'
        "  sdforge export --out export/sd-phase7\n"
        "  sdforge check\n"
        "`sdforge <command> --help` lists a command's options; the manual is README.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_export(sub)
    ev = sub.add_parser("evaluate", help="FID and CLIP score of a phase on a standard protocol (COCO-2014 val)")
    ev.add_argument("--protocol", choices=["coco"], default="coco", help="coco: COCO-2014 val captions (docs/EVAL.md)")
    ev.add_argument("--phase", default=None, help="the phase whose checkpoint is evaluated (default: the last)")
    ev.add_argument("--checkpoint", default=None, help="a checkpoint dir instead of the phase's")
    ev.add_argument("--samples", type=int, default=None, help="captions (default: eval.coco.samples, 30,000)")
    ev.add_argument("--live", action="store_true", help="live instead of EMA weights")
    ev.add_argument("--device", default="auto", help="auto (CUDA, MPS, CPU), cpu, cuda, mps")
    ev.add_argument("--out", default=None, help="default: ${paths.evaluations}/<phase>/coco-<samples>/")
    ev.add_argument("--params", default="params.yaml")
    ev.set_defaults(func=_evaluate)
    rep = sub.add_parser("report", help="write eval/report.html comparing the phases that have finished")
    rep.add_argument("--mlflow", action="store_true", help="also log it to MLflow (as the report stage does)")
    rep.add_argument("--params", default="params.yaml")
    rep.set_defaults(func=_report)
    runs = sub.add_parser("runs", help="list (or clean) the run dirs train moved aside because its inputs changed")
    runs.add_argument("action", choices=["list", "clean"], help="clean deletes them (with --yes)")
    runs.add_argument("--phase", default=None, help="only this phase's stale runs")
    runs.add_argument("--yes", action="store_true", help="clean: really delete")
    runs.add_argument("--params", default="params.yaml")
    runs.set_defaults(func=_runs)
    flush = sub.add_parser("tracking-flush", help="log the short stages' spooled MLflow runs now (tracking.spool)")
    flush.add_argument("--params", default="params.yaml")
    flush.set_defaults(func=_tracking_flush)
    chk = sub.add_parser("check", help="validate params.yaml (size, aliases, names) before a bare `dvc repro`")
    chk.add_argument("--params", default="params.yaml")
    chk.set_defaults(func=_check)
    # its options are tools.preflight's own parser (main() hands the command line over before this one is built)
    sub.add_parser(
        "preflight",
        add_help=False,
        help="run the full configuration's whole DAG on a small sample; forecast the run (its options: --help)",
    )
    return parser


def _add_generate(sub) -> None:
    """``sdforge generate``'s arguments."""
    gen = sub.add_parser("generate", help="sample images from a phase checkpoint (EMA weights by default)")
    gen.add_argument("--prompt", action="append", required=True, help="prompt (repeat for several)")
    gen.add_argument("--negative", default="", help="negative prompt (default: empty)")
    gen.add_argument(
        "--steps", type=int, default=None, help="sampler steps (default: eval.steps; a distilled phase: its few steps)"
    )
    gen.add_argument(
        "--guidance",
        type=float,
        default=None,
        help="CFG scale, 1: none (default: eval.guidance_scale; distilled phase: 1)",
    )
    gen.add_argument("--category", default=None, help="take steps/guidance defaults from this eval category")
    gen.add_argument("--seed", type=int, default=0, help="seed of the first image (0 … 2**63-1); image i uses seed+i")
    gen.add_argument("--num-images", type=int, default=1, help="images per prompt (at least 1)")
    gen.add_argument("--batch-size", type=int, default=8)
    gen.add_argument(
        "--width",
        type=int,
        default=None,
        help=f"image width in px (default: the model's size; at most that × {MAX_SIZE_FACTOR})",
    )
    gen.add_argument("--height", type=int, default=None, help="image height in px (a multiple of 64 for SD)")
    gen.add_argument("--checkpoint", default=None, help="phase checkpoint dir (default: the last phase's)")
    gen.add_argument("--live", action="store_true", help="use live instead of EMA weights")
    gen.add_argument(
        "--fuse-lora",
        action="store_true",
        help="fuse an unmerged adapter into the UNet: sample the fused form that `sdforge export` writes by default",
    )
    gen.add_argument(
        "--control-image", action="append", type=Path, default=None,
        help="a ControlNet phase's conditioning image (white Canny edges on black, the image's size): once for "
        "every image, or once per --prompt",
    )  # fmt: skip
    gen.add_argument("--device", default="auto", help="auto (CUDA, MPS, CPU), cpu, cuda, mps")
    gen.add_argument("--out", default="generated", help="output folder (created if missing; not a file)")
    gen.add_argument("--params", default="params.yaml")
    gen.set_defaults(func=_generate)


def _add_export(sub) -> None:
    """``sdforge export``'s arguments."""
    exp = sub.add_parser("export", help="write a diffusers StableDiffusionPipeline folder (EMA weights by default)")
    exp.add_argument(
        "--out",
        required=True,
        help="output folder: new or empty, outside the workspace's folders (paths.*); a previous export only with "
        "--overwrite",
    )
    exp.add_argument("--overwrite", action="store_true", help="replace the previous export in --out")
    exp.add_argument("--checkpoint", default=None, help="phase checkpoint dir (default: the last phase's)")
    exp.add_argument("--live", action="store_true", help="export live instead of EMA weights")
    exp.add_argument(
        "--lora-file",
        action="store_true",
        help="keep an unmerged adapter as pytorch_lora_weights.safetensors beside the base UNet instead of fusing it",
    )
    exp.add_argument("--mlflow-register", default=None, metavar="NAME", help="register as a version of model NAME")
    exp.add_argument("--params", default="params.yaml")
    exp.set_defaults(func=_export)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``sdforge`` console script.

    Bad input — params, or a checkpoint or model folder that does not load — is one logged line and status 2
    (the message names the file and what to do), never a library traceback.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["preflight"]:
        from tools.preflight import main as preflight_main  # lazy: the preflight's own parser and imports (~2 s)

        sys.exit(preflight_main(argv[1:]))
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        status = args.func(args)
    except (ConfigError, InputError) as err:
        log.error("%s", err)
        status = 2
    sys.exit(status)


if __name__ == "__main__":
    main()
