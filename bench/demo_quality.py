"""Benchmark: does the demo model learn colour and shape, for every train seed?

``python -m bench.demo_quality [--seeds N] [--text-encoder-seeds S ...] [--quick] [--params params.yaml]
[--out .bench/demo_quality] [--phases K] [--set KEY=VALUE ...]``

Trains the demo's phases (phase 0 … phase 8, each from the previous one's EMA weights) on the already encoded demo
latents (``${paths.latents}``, ``${paths.models}`` and ``${paths.checkpoints}/scratch``: run ``make demo`` or ``dvc
repro encode_latents`` first) for train seeds 0 … N-1 and each draw of the demo's text encoder (its build seed,
``models.text_encoder_build.seed``: a draw other than the one in ``${paths.models}`` is built into the work dir,
with its own empty-prompt embedding; the VAE and the latents stay), in this process, with the stages' own ``run``
functions (``mix_phase``, ``train``, ``eval_grid``) on a copy of ``params.yaml`` whose outputs go under ``--out``
and whose MLflow tracking and training validation images are off (neither changes the weights). After the first
phase, the last full phase (phase 7) and the adapter phase (phase 8) it samples the eval grid and reads each image
with the demo probe: colour and shape agreement on the seen, the held-out and the concept (the adapter's new
colour) prompts, and the probe's own score on ground-truth renders of the same prompts.

The baseline is issue 40's acceptance bars (:data:`BARS`), not another implementation: the last line is ``RESULT
name=demo_quality ratio=<min over every run and bar of figure ÷ bar> ...``: ≥ 1 when every run meets every bar
(phase 7: colour ≥ 15/16 and shape ≥ 14/16 seen, held-out colour ≥ 75 % and shape ≥ 60 %; phase 8: the new colour ≥
75 % on each background, the old prompts' colour ≥ 14/16). ``--quick`` trains seed 0's first phase for one epoch
only and evaluates it: a check that the harness runs, not a quality figure. ``--phases K`` trains the first K
phases only; ``--set phases.phase1.lr=1e-3`` (repeatable, YAML values) measures a change without editing
``params.yaml``. ``--from-phase phase8`` continues the work dirs an earlier invocation left (same seeds and
draws): the phases before it are not retrained (their checkpoints are reused) and only it and later phases are
scored — minutes instead of ~20 to measure a change of the adapter phase over all six runs. ``--rescore``
trains nothing: it samples and scores the work dirs' checkpoints again, for an ``eval`` setting's change
(``--set eval.guidance_scale=5``).

Issue 41's validation loss (``train.held_out``, ``train.val_loss_every``): each run prints phase 1's validation
loss at every measurement, and the RESULT line adds ``phase1_val_loss_falls`` (runs whose last measurement is
below the first), ``phase1_val_loss_falls_every_time`` and ``val_loss_share_median`` (its seconds ÷ the
training seconds). When the base phase (phase 7) chose a post-hoc EMA in this call, :mod:`bench._ema_study` scores
its candidates (the fixed EMA and each rebuilt σ_rel) and every earlier full phase both by the validation loss on
phase 7's held-out set and by the probe: the RESULT line adds ``posthoc_no_worse`` (runs whose exported EMA
probes at least as well as the fixed one) and the median Spearman correlations ``rho_candidates_median``,
``rho_phases_median``, ``rho_all_median`` (``--no-ema-study`` skips it: ~15 more eval grids per run).
``--study-only`` trains nothing: on an earlier invocation's work dirs it follows phase 1's σ_rel 0.10 EMA through
training (rebuilt at each snapshot step) and prints ``rho_trajectory_median`` / ``_min`` (the validation loss's
ranking of those weights against the probe's), plus the study above unless ``--no-ema-study``. Its ratio: with the
study, the post-hoc choice's probe score ÷ the fixed EMA's (lowest over the runs); without, the lowest ρ.
"""

from __future__ import annotations

import argparse
import logging
import math
import shutil
import statistics
import time
from pathlib import Path

import yaml

from bench._common import load_average, machine, result_line
from bench._ema_study import chosen_name, study, trajectory
from bench._few_step import few_step_study, share_of_teacher
from bench._few_step import lines as few_step_lines
from model.denoisers import family
from model.text_stack import TextStack, text_part_dirs
from sdforge.config import SCRATCH, Params, load_params
from sdforge.demo.models import build_demo_text_encoders
from sdforge.io import write_json
from sdforge.training.reporting import read_steps
from stages import eval_grid, mix_phase, train
from stages.prepare_models import UNCOND_EMBEDDING, save_uncond_embedding

REPO = Path(__file__).resolve().parents[1]
OUTPUTS = ("mixes", "checkpoints", "runs", "eval", "metrics")
"""``paths`` keys redirected under the seed's work dir (inputs — latents, models — stay where they are)."""
KEYS = (
    "colour_agreement_seen",
    "shape_agreement_seen",
    "colour_agreement_held_out",
    "shape_agreement_held_out",
    "colour_agreement_concept",
    "colour_agreement_concept_on_white",
    "colour_agreement_concept_on_black",
    "shape_agreement_concept",
)
BARS = {
    ("base", "colour_agreement_seen"): 15 / 16,
    ("base", "shape_agreement_seen"): 14 / 16,
    ("base", "colour_agreement_held_out"): 0.75,
    ("base", "shape_agreement_held_out"): 0.60,
    ("adapter", "colour_agreement_concept_on_white"): 0.75,
    ("adapter", "colour_agreement_concept_on_black"): 0.75,
    ("adapter", "colour_agreement_seen"): 14 / 16,
}
"""Issue 40's bars, per (evaluated phase tag, figure): every run must meet each; the RESULT ratio is the lowest
figure ÷ bar."""

log = logging.getLogger("bench.demo_quality")


def apply_overrides(data: dict, overrides: list[str]) -> None:
    """Set each ``dotted.key=value`` (value parsed as YAML) in ``data``; an unknown section is an error."""
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. phases.phase1.lr=1e-3")
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            if not isinstance(node.get(part), dict):
                raise SystemExit(f"--set {item!r}: params has no section {part!r} under {key!r}")
            node = node[part]
        node[leaf] = yaml.safe_load(value)


def seed_params(base: Path, work: Path, seed: int, quick: bool, phases: int = 0, overrides=()) -> Params:
    """``base`` with ``train.seed = seed``, outputs under ``work``, tracking and validation off; ``phases``
    > 0 keeps the first ``phases`` phases; ``overrides`` as :func:`apply_overrides`."""
    data = yaml.safe_load(base.read_text())
    apply_overrides(data, list(overrides))
    if phases:
        data["phases"] = dict(list(data["phases"].items())[:phases])
    root = base.resolve().parent
    for key, value in data["paths"].items():
        data["paths"][key] = str(work / key) if key in OUTPUTS else str(root / value)
    data["train"].update(seed=seed, validation_every=0, progress_bar=False)
    data.setdefault("tracking", {})["enabled"] = False
    if quick:
        first = next(iter(data["phases"]))
        data["phases"] = {first: {**data["phases"][first], "epochs": 1}}
    path = work / "params.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_params(path)


def check_inputs(params: Params) -> None:
    """Raise naming what is missing and how to make it when the encoded demo is not there."""
    needed = [Path(params.paths.latents), Path(params.paths.models)]
    missing = [str(p) for p in needed if not p.exists()]
    if missing:
        raise SystemExit(
            f"bench.demo_quality: missing {', '.join(missing)}; run `make demo` (or `dvc repro encode_latents`) first"
        )


def write_scratch_unet(params: Params, out: Path) -> None:
    """Phase 1's seeded initial denoiser from ``models.<family>`` (as ``prepare_models`` writes it): a ``--set
    models.unet...`` change needs its own; the frozen VAE and text encoders are reused."""
    denoiser_family = family(params.models.denoiser.family)
    unet = denoiser_family.build(denoiser_family.config(params.models.denoiser_spec), params.models.seed)
    for sub in ("unet", "unet_ema"):
        unet.save_pretrained(out / sub, safe_serialization=True)
    write_json(out / "state.json", {"phase": SCRATCH, "step": 0})


def evaluated_phases(params: Params) -> dict[str, str]:
    """tag → phase the probe scores: ``first``, ``base`` (the last full fine-tune: the demo's phase 7), ``adapter``
    when the last phase that is no distillation is an adapter (the demo's phase 8), and ``distilled``, the last
    distill phase (the demo's phase 9: its few-step figures come from :mod:`bench._few_step`)."""
    names = list(params.phases)
    full = [n for n in names if params.phases[n].adapter is None] or names
    tags = {"first": names[0], "base": full[-1]}
    trained = [n for n in names if params.phases[n].distill is None]
    if params.phases[trained[-1]].adapter is not None:
        tags["adapter"] = trained[-1]
    distilled = [n for n in names if params.phases[n].distill is not None]
    if distilled:
        tags["distilled"] = distilled[-1]
    return tags


def use_text_encoder_draw(base: Path, params: Params, work: Path) -> Params:
    """``params`` itself when its text-encoder draw is the one ``base`` built into ``${paths.models}``; else
    a copy of that folder under ``work`` with the draw rebuilt (and its empty-prompt embedding), and the params
    pointing at it."""
    if params.models.text_encoder_seed == load_params(base).models.text_encoder_seed:
        return params
    models = work / "models"
    if not models.exists():  # a --from-phase run reuses the draw its earlier invocation built
        shutil.copytree(params.paths.models, models)
        denoiser_family = family(params.models.denoiser.family)
        tokenizers, encoders, _ = build_demo_text_encoders(params.models, params.demo, params.eval, models,
                                                            denoiser_family)  # fmt: skip
        for encoder, (encoder_dir, _) in zip(encoders, text_part_dirs(denoiser_family), strict=True):
            shutil.rmtree(models / encoder_dir)
            encoder.save_pretrained(models / encoder_dir, safe_serialization=True)
        save_uncond_embedding(TextStack(denoiser_family, tokenizers, encoders), models / UNCOND_EMBEDDING)
    data = yaml.safe_load((work / "params.yaml").read_text())
    data["paths"]["models"] = str(models)
    (work / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return load_params(work / "params.yaml")


def train_seed(
    base: Path,
    out: Path,
    seed: int,
    quick: bool,
    phases: int = 0,
    overrides=(),
    draw=None,
    from_phase=None,
    rescore: bool = False,
    ema_study: bool = True,
) -> dict:
    """Mix, train and evaluate every phase for one train seed (and text-encoder ``draw``: None keeps params'); the
    probe figures of :func:`evaluated_phases`. ``from_phase``: continue the work dir from that phase; ``rescore``:
    train nothing, sample and score the work dir's checkpoints again (an eval setting's change); ``ema_study``: when
    the base phase chose a post-hoc EMA in this call, :func:`bench._ema_study.study` it."""  # fmt: skip
    work = out / (f"seed-{seed}" if draw is None else f"text-encoder-{draw}/seed-{seed}")
    if from_phase is None and not rescore:
        shutil.rmtree(work, ignore_errors=True)
    elif not (work / "checkpoints").is_dir():
        flag = f"--from-phase {from_phase}" if from_phase else "--rescore"
        raise SystemExit(f"bench.demo_quality: {flag}: no earlier run in {work}; run without it")
    work.mkdir(parents=True, exist_ok=True)
    overrides = [*overrides, *([] if draw is None else [f"models.text_encoder_build.seed={draw}"])]
    params = seed_params(base, work, seed, quick, phases, overrides)
    check_inputs(params)
    params = use_text_encoder_draw(base, params, work)
    paths = params.paths
    names = list(params.phases)
    if from_phase is None and not rescore:
        write_scratch_unet(params, Path(paths.checkpoints) / SCRATCH)
    elif from_phase is not None and from_phase not in names:
        raise SystemExit(f"bench.demo_quality: --from-phase {from_phase}: not a phase of {base} ({names})")
    trained = names[names.index(from_phase) :] if from_phase else names
    tags = {tag: phase for tag, phase in evaluated_phases(params).items() if phase in trained}
    result: dict = {"seed": seed, "draw": params.models.text_encoder_seed, "train_s": 0.0, "val_loss_s": 0.0,
                    "tags": tags}  # fmt: skip
    for name in trained:
        if not rescore:
            index = Path(paths.mixes) / f"{name}.parquet"
            mix_phase.run(name, params.phases[name], Path(paths.latents), index, seed, params.phase_resolution(name),
                          params.train.held_out)  # fmt: skip
            start = time.perf_counter()
            metrics = train.run(params, name)
            result[f"{name}_steps"] = metrics["steps"]
            result[f"{name}_posthoc"] = "posthoc_ema.snapshots" in metrics and chosen_name(metrics)
            result["val_loss_s"] += metrics.get("val_loss_seconds", 0.0)
            result[f"{name}_val_loss"] = [(s, r["val_loss"]) for s, r in read_steps(Path(paths.runs) / name).items()
                                          if "val_loss" in r]  # fmt: skip
            result["train_s"] += time.perf_counter() - start
        if name not in tags.values():
            continue
        grid = eval_grid.run(
            params.eval, params.demo, Path(paths.models), Path(paths.checkpoints) / name, Path(paths.eval) / name
        )
        for tag in (t for t, phase in tags.items() if phase == name):
            result.update({f"{tag}_{k}": grid.get(k) for k in (*KEYS, "probe_truth_colour", "probe_truth_shape")})
        if name == tags.get("distilled"):
            result["few_step"] = few_step_study(params, name)
        if ema_study and name == tags.get("base") and result.get(f"{name}_posthoc"):
            result["study"] = study(params, name, result[f"{name}_posthoc"])
    log.info("seed %d, text encoder %d: %s", seed, result["draw"], result)
    return result


def study_seed(base: Path, out: Path, seed: int, overrides=(), draw=None, with_study: bool = True) -> dict:
    """``--study-only``: train nothing; on the work dir an earlier invocation left, follow the first post-hoc phase's
    EMA through its training (:func:`~bench._ema_study.trajectory`) and, ``with_study``, :func:`bench._ema_study.study`
    the base phase (a training invocation did that already unless ``--no-ema-study``)."""
    work = out / (f"seed-{seed}" if draw is None else f"text-encoder-{draw}/seed-{seed}")
    if not (work / "checkpoints").is_dir():
        raise SystemExit(f"bench.demo_quality: --study-only: no earlier run in {work}; run without it")
    overrides = [*overrides, *([] if draw is None else [f"models.text_encoder_build.seed={draw}"])]
    params = use_text_encoder_draw(base, seed_params(base, work, seed, False, 0, overrides), work)
    tags = evaluated_phases(params)
    tracked = [n for n, p in params.phases.items() if p.posthoc_ema and p.adapter is None]
    if not params.train.posthoc_sigma_rels or not tracked:
        raise SystemExit("bench.demo_quality: --study-only: no phase tracks a post-hoc EMA (train.posthoc_sigma_rels)")
    result = {"seed": seed, "draw": params.models.text_encoder_seed, "tags": tags, "train_s": 0.0,
              "trajectory": trajectory(params, tracked[0]), "trajectory_phase": tracked[0]}  # fmt: skip
    if with_study:
        result["study"] = study(params, tags["base"])
    log.info("seed %d, text encoder %d: %s", seed, result["draw"], result)
    return result


def default_draws(base: Path) -> list[int]:
    """The text encoder ``base`` builds (draw D) and the next one (D + 1)."""
    draw = load_params(base).models.text_encoder_seed
    return [draw, draw + 1]


DISTILLED_SHARE = 0.9
"""Issue 42's bar: the distilled phase's few-step colour and shape agreement keep ≥ 90 % of its teacher's 50-step."""


def bar_ratio(results: list[dict]) -> tuple[float, list[str]]:
    """The lowest figure ÷ bar over every run and :data:`BARS` entry the runs measured (and :data:`DISTILLED_SHARE`
    where a run has few-step figures), and the misses."""
    ratios, misses = [], []
    for r in results:
        if r.get("few_step"):
            share = share_of_teacher(r["few_step"])
            ratios.append(share / DISTILLED_SHARE)
            if share < DISTILLED_SHARE:
                misses.append(f"seed {r['seed']} text encoder {r['draw']}: {r['tags']['distilled']} keeps "
                              f"{share:.3f} < {DISTILLED_SHARE} of its teacher's 50-step probe")  # fmt: skip
        for (tag, key), bar in BARS.items():
            value = r.get(f"{tag}_{key}")
            if value is None:
                continue
            ratios.append(value / bar)
            if value < bar:
                run = f"seed {r['seed']} text encoder {r['draw']}: {r['tags'][tag]}"
                misses.append(f"{run} {key} {value:.3f} < {bar:.3f}")
    return (min(ratios) if ratios else float("nan")), misses


def summary_table(results: list[dict], tags: dict[str, str]) -> list[str]:
    """Markdown rows: per seed, each evaluated phase's agreements (concept: the adapter's new colour)."""
    names = " | ".join(k.replace("_agreement_", " ").replace("_", "-") for k in KEYS)
    head = f"| text encoder | seed | phase | {names} | train s |"
    rows = [head, "|---" * (len(KEYS) + 4) + "|"]
    for r in results:
        for tag, name in tags.items():
            cells = " | ".join(_pct(r.get(f"{tag}_{k}")) for k in KEYS)
            rows.append(f"| {r['draw']} | {r['seed']} | {name} | {cells} | {r['train_s']:.0f} |")
    return rows


def val_loss_fields(results: list[dict]) -> dict:
    """Issue 41's validation-loss figures: in how many runs phase 1's validation loss fell from its first to its
    last measurement (and at every measurement), and its time as a share of the training time (median)."""
    curves = [r.get("phase1_val_loss") or [] for r in results]
    curves = [[v for _, v in c] for c in curves if len(c) > 1]
    for r in results:
        if curve := r.get("phase1_val_loss"):
            print(f"seed {r['seed']} text encoder {r['draw']}: phase1 val loss " +
                  " ".join(f"{s}:{v:.4f}" for s, v in curve))  # fmt: skip
    monotone = sum(all(b < a for a, b in zip(c, c[1:], strict=False)) for c in curves)
    return {
        "phase1_val_loss_falls": f"{sum(c[-1] < c[0] for c in curves)}/{len(curves)}",
        "phase1_val_loss_falls_every_time": f"{monotone}/{len(curves)}",
        "val_loss_share_median": _stat(
            [{"x": r["val_loss_s"] / r["train_s"]} for r in results if r["train_s"]], "x", statistics.median
        ),  # fmt: skip
    }


def ema_study_fields(results: list[dict]) -> dict:
    """Issue 41's post-hoc EMA figures: per run, each candidate's and earlier phase's validation loss and probe score
    (printed); on the RESULT line the runs whose chosen EMA probes no worse than the fixed one, and the median rank
    correlations (validation loss vs probe) over the candidates, the phases and both."""
    studied = [r for r in results if r.get("study")]
    fields = trajectory_fields(results)
    if not studied:
        return fields
    for r in studied:
        s = r["study"]
        rows = " ".join(f"{x['kind'][0]}:{x['name']}={x['val_loss']:.4f}/{x['probe']:.3f}" for x in s["rows"])
        print(f"seed {r['seed']} text encoder {r['draw']}: chosen {s['chosen']} "
              f"(probe {s['chosen_minus_fixed']:+.3f} vs fixed); rho candidates {s['rho_candidates']:.2f} "
              f"phases {s['rho_phases']:.2f} all {s['rho_all']:.2f}; val_loss/probe {rows}")  # fmt: skip
    fields["posthoc_no_worse"] = f"{sum(r['study']['chosen_minus_fixed'] >= 0 for r in studied)}/{len(studied)}"
    for key in ("rho_candidates", "rho_phases", "rho_all"):  # NaN: the probe scored every set alike (no ranking)
        defined = [r["study"] for r in studied if not math.isnan(r["study"][key])]
        fields[f"{key}_median"] = _stat(defined, key, statistics.median)
        fields[f"{key}_defined"] = f"{len(defined)}/{len(studied)}"
    return fields


def trajectory_fields(results: list[dict]) -> dict:
    """Per run, the post-hoc phase's EMA through training (step: validation loss / probe), printed; the median and
    lowest rank correlation on the RESULT line."""
    fields: dict = {}
    traced = [r for r in results if r.get("trajectory")]
    for r in traced:
        rows = " ".join(f"{x['step']}:{x['val_loss']:.4f}/{x['probe']:.3f}" for x in r["trajectory"]["rows"])
        print(f"seed {r['seed']} text encoder {r['draw']}: {r['trajectory_phase']} EMA through training, rho "
              f"{r['trajectory']['rho']:.2f}; step:val_loss/probe {rows}")  # fmt: skip
    if traced:
        fields["rho_trajectory_median"] = _stat([r["trajectory"] for r in traced], "rho", statistics.median)
        fields["rho_trajectory_min"] = _stat([r["trajectory"] for r in traced], "rho", min)
    return fields


def few_step_fields(results: list[dict]) -> dict:
    """Issue 42's figures, per run printed (teacher at 50 steps, at the student's steps and at its UNet calls; the
    student), and on the RESULT line: the lowest share of the teacher's 50-step probe the student keeps, and in how
    many runs it beats the teacher at the same steps and at the same UNet calls (colour + shape)."""
    studied = [r for r in results if r.get("few_step")]
    if not studied:
        return {}
    for r in studied:
        print(f"seed {r['seed']} text encoder {r['draw']}: few-step sampling (seen prompts x 4 seeds)")
        for line in few_step_lines(r["few_step"]):
            print(line)

    def total(f: dict) -> float:
        return f["colour"] + f["shape"]

    beats = sum(total(r["few_step"]["student"]) > total(r["few_step"]["teacher_few"]) for r in studied)
    beats_calls = sum(total(r["few_step"]["student"]) > total(r["few_step"]["teacher_same_calls"]) for r in studied)
    student = [r["few_step"]["student"] for r in studied]
    return {
        "distilled_share_of_teacher50_min": min(share_of_teacher(r["few_step"]) for r in studied),
        "distilled_beats_teacher_same_steps": f"{beats}/{len(studied)}",
        "distilled_beats_teacher_same_unet_calls": f"{beats_calls}/{len(studied)}",
        "distilled_colour_median": _stat(student, "colour", statistics.median),
        "distilled_shape_median": _stat(student, "shape", statistics.median),
        "teacher_few_colour_median": _stat(
            [r["few_step"]["teacher_few"] for r in studied], "colour", statistics.median
        ),  # fmt: skip
        "teacher_few_shape_median": _stat([r["few_step"]["teacher_few"] for r in studied], "shape", statistics.median),
    }


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f} %"


def _stat(results: list[dict], key: str, fn) -> float:
    values = [r[key] for r in results if r.get(key) is not None]
    return float(fn(values)) if values else float("nan")


def main(argv: list[str] | None = None) -> None:
    """CLI: train every seed, print the table and the RESULT line."""
    parser = argparse.ArgumentParser(prog="python -m bench.demo_quality")
    parser.add_argument("--seeds", type=int, default=3, help="train seeds 0 … N-1 (default 3)")
    parser.add_argument(
        "--train-seeds",
        type=int,
        nargs="+",
        default=None,
        metavar="S",
        help="these train seeds instead of 0 … N-1 (e.g. to finish an interrupted measurement)",
    )
    parser.add_argument(
        "--text-encoder-seeds",
        type=int,
        nargs="+",
        default=None,
        metavar="S",
        help="text-encoder build seeds (default: params' draw D and D + 1); each runs every train seed",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="seed 0, params' text encoder, the first phase for one epoch: a harness check",
    )
    parser.add_argument("--params", type=Path, default=REPO / "params.yaml")
    parser.add_argument("--out", type=Path, default=REPO / ".bench" / "demo_quality")
    parser.add_argument("--phases", type=int, default=0, help="train the first K phases only (0: all)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a params key")
    parser.add_argument(
        "--from-phase",
        default=None,
        metavar="PHASE",
        help="continue an earlier invocation's work dirs from PHASE (earlier phases not retrained)",
    )
    parser.add_argument(
        "--rescore",
        action="store_true",
        help="train nothing: sample and score an earlier invocation's checkpoints again (eval --set)",
    )
    parser.add_argument(
        "--no-ema-study",
        dest="ema_study",
        action="store_false",
        help="skip scoring the base phase's post-hoc EMA candidates and earlier phases on the probe",
    )
    parser.add_argument(
        "--study-only",
        action="store_true",
        help="train nothing: score an earlier invocation's post-hoc EMAs (phase 1's EMA through "
        "training; phase 7's candidates and the earlier phases unless --no-ema-study) by "
        "validation loss and probe",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    load_before = load_average()
    seeds = [0] if args.quick else args.train_seeds or list(range(args.seeds))
    draws = [None] if args.quick else args.text_encoder_seeds or default_draws(args.params)
    out = args.out.resolve()
    if args.study_only:
        results = [study_seed(args.params, out, s, args.set, d, args.ema_study) for d in draws for s in seeds]
    else:
        results = [
            train_seed(
                args.params, out, s, args.quick, args.phases, args.set, d, args.from_phase, args.rescore, args.ema_study
            )
            for d in draws
            for s in seeds
        ]
    tags = results[0]["tags"]
    for row in summary_table(results, tags) if not args.study_only else []:
        print(row)
    ratio, misses = bar_ratio(results)
    for miss in misses:
        print(f"below its bar: {miss}")
    fields = {
        "runs": len(results),
        "seeds": len(seeds),
        "text_encoder_seeds": ",".join(map(str, draws)),
        "below_bar": len(misses),
        "quick": args.quick,
    }
    for tag, name in tags.items():
        for key in KEYS:
            if all(r.get(f"{tag}_{key}") is None for r in results):
                continue
            fields[f"{name}_{key}_min"] = _stat(results, f"{tag}_{key}", min)
            fields[f"{name}_{key}_median"] = _stat(results, f"{tag}_{key}", statistics.median)
    truths = [r.get(f"{tag}_probe_truth_{k}") for r in results for tag in tags for k in ("colour", "shape")]
    fields["probe_truth_min"] = min((t for t in truths if t is not None), default=float("nan"))
    if args.study_only and args.ema_study:  # ours = the post-hoc choice, baseline = the fixed EMA, on the probe
        ratio = min(r["study"]["chosen_probe"] / r["study"]["fixed_probe"] for r in results)
    elif args.study_only:  # the lowest agreement of the validation loss's ranking with the probe's (1: the same)
        ratio = min(r["trajectory"]["rho"] for r in results)
    fields["train_s_median"] = _stat(results, "train_s", statistics.median)
    fields.update(val_loss_fields(results))
    fields.update(ema_study_fields(results))
    fields.update(few_step_fields(results))
    fields["load_avg"] = f"{load_before} -> {load_average()}"
    fields["machine"] = machine()
    print(result_line("demo_quality", ratio, **fields))


if __name__ == "__main__":
    main()
