"""The preflight's forecast: what the full run costs, from what the preflight measured on this device.

Inputs are plain values: the measured stages (:class:`StageRun`: wall time, peak RSS, the stage's metrics
JSON, for ``train`` the per-step times), the FULL configuration's params dict (its work: images per source,
samples × epochs per phase) and a :class:`Pod` (the GPUs to project for). Output: one :class:`Row` per
stage type, plus the full run's totals.

How each stage type is projected (the rates are per image; "this device" uses the measured one):

* ``fetch_images``: not projected from the sample — two images over loopback measure process start-up,
  and a real fetch is bound by the network and the image hosts. ``Pod.fetch_img_s`` is an assumption
  (img2dataset's README: ~1,400 img/s per 16-core machine; 1,000 taken), scaled by CPU cores for this device.
* ``encode_latents``: images / the encode pipeline's own seconds (model loading excluded);
  on the pod ``Pod.encode_img_s`` per GPU.
* ``train``: samples / step time (from ``runs/<phase>/steps.jsonl``, checkpoint writes excluded; the first
  step of each phase is dropped when there are more), on the pod ``Pod.train_img_s`` per GPU;
  full work = Σ phases ``samples × epochs``.
* ``eval_grid``: UNet evaluations (prompts × steps × 2 for classifier-free guidance) per second;
  the pod rate is assumed to be 3 × the training rate per GPU (a sampling step is a forward only:
  ~1/3 of a training step's FLOPs) — an assumption, stated in the table.
* ``caption_images``: the images of recaptioned sources / the measured captioning rate (a source without
  ``recaption`` is a no-op: "fixed"); no pod rate is assumed.
* ``eval_coco`` (a row of its own, measured inside ``eval_grid``): the COCO protocol's UNet calls per second
  (sampling, CLIP score and FID together in the time) × the full run's ``phase_end_samples × phases × steps × 2``;
  on the pod at the eval grid's assumed rate.
* the other stages (metadata, filter, mix, prepare_models) do not scale with the sample: their measured
  time is reported, not projected ("fixed").

Nothing here is a GPU measurement: the pod figures are the stated assumptions of :class:`Pod`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from sdforge.preflight.derive import samples_needed
from sdforge.training.parallel import replicated_state_bytes

GIB = 1024**3
FIXED = ("make_demo_data", "download_metadata", "filter_metadata", "prepare_models", "mix_phase", "export", "generate")


@dataclass
class StageRun:
    """One DVC stage instance the preflight ran."""

    name: str
    wall_s: float
    peak_rss_bytes: int
    metrics: dict[str, Any] = field(default_factory=dict)
    steps: list[tuple[float, int]] = field(default_factory=list)
    """``train`` only: (seconds, samples over all ranks) per optimizer step, in step order."""

    @property
    def kind(self) -> str:
        return self.name.split("@", 1)[0]


@dataclass(frozen=True)
class Pod:
    """The machine to project for. The defaults are assumptions, not measurements (see ``docs/PREFLIGHT.md``)."""

    gpus: int = 2
    train_img_s: float = 64.0
    """Per GPU. Default: NeMo's published out-of-the-box SD1.x figure on one H100."""
    encode_img_s: float = 270.0
    """Per GPU. Default: SD-VAE encode at 512², 1.12 TFLOP/img at 30 % of an H100's bf16 peak."""
    fetch_img_s: float = 1000.0
    """Whole pod (16 cores assumed). Default: below img2dataset's published ~1,400 img/s per 16-core machine."""
    price_per_gpu_hour: float = 2.49
    name: str = "H100 (assumed figures)"


@dataclass
class Row:
    """One stage type of the forecast."""

    stage: str
    runs: int
    wall_s: float
    peak_rss_gib: float
    rate: float | None = None
    unit: str = ""
    full_work: float | None = None
    device_hours: float | None = None
    pod_hours: float | None = None
    note: str = ""


def full_images(full: dict[str, Any]) -> dict[str, int]:
    """Per source, the images the full run needs: the most any phase draws from it."""
    return {name: n for name, n in samples_needed(full).items() if n}


def full_train_samples(full: dict[str, Any], distill: bool | None = None) -> int:
    """Σ over phases of ``samples × epochs``: the images the full run trains on (``distill`` True / False: only the
    distillation phases / only the others; None: all).

    Every sample is projected at the measured training rate, whatever its phase's resolution:
    a 256² phase (``phase0``) costs ~4.5× less per sample than the 512² phases, so its share of
    the train forecast is an upper bound.
    """
    phases = full.get("phases", {}).values()
    chosen = [p for p in phases if distill is None or bool(p.get("distill")) == distill]
    return sum(int(p["samples"]) * int(p["epochs"]) for p in chosen)


TRAIN_DISTILL = "train_distill"
"""The forecast row of the distillation phases' ``train`` runs (``phases.<p>.distill``): a sample there costs the
student's forward and backward plus three UNet forwards without gradient (the teacher's guided pair, the target),
so they get their own measured rate and, on the pod, half the training rate (assumed)."""


def run_kind(run: StageRun, full: dict[str, Any]) -> str:
    """The forecast row ``run`` counts in: its stage's name, or :data:`TRAIN_DISTILL` for a distill phase's train."""
    phase = run.name.split("@", 1)[1] if "@" in run.name else ""
    if run.kind == "train" and full.get("phases", {}).get(phase, {}).get("distill"):
        return TRAIN_DISTILL
    return run.kind


def phase_steps(phase: dict[str, Any], gpus: int) -> int:
    """Optimizer steps of one phase with ``gpus`` processes."""
    per_step = int(phase["batch_size"]) * int(phase.get("grad_accum", 1)) * gpus
    return math.ceil(int(phase["samples"]) * int(phase["epochs"]) / per_step)


def full_optimizer_steps(full: dict[str, Any], gpus: int) -> int:
    """Optimizer steps of the full run with ``gpus`` processes."""
    return sum(phase_steps(p, gpus) for p in full.get("phases", {}).values())


def full_val_loss_forwards(full: dict[str, Any], gpus: int) -> int:
    """Held-out sample forward passes of the full run's validation losses: per phase, ``held_out × its sources ×
    val_loss_timesteps`` per measurement, one every ``val_loss_every`` steps and one at the end (main rank)."""
    train = full.get("train", {})
    held_out, every, points = int(train.get("held_out", 0)), int(train.get("val_loss_every", 0)), int(
        train.get("val_loss_timesteps", 8))
    total = 0
    for p in full.get("phases", {}).values() if held_out else []:
        steps = phase_steps(p, gpus)
        measurements = (steps // every if every else 0) + (0 if every and steps % every == 0 else 1)
        total += held_out * len(p["mix"]) * points * measurements
    return total


def posthoc_ema_cost(full: dict[str, Any], unet_params: int | None) -> dict[str, float] | None:
    """The post-hoc EMA's extra memory (its fp32 tracked EMAs) and run-dir disk per phase (its snapshots), GiB;
    None when ``train.posthoc_sigma_rels`` is off or the UNet's size is unknown."""
    train = full.get("train", {})
    profiles = len(train.get("posthoc_sigma_rels") or [])
    if not profiles or not unet_params:
        return None
    copy = unet_params * 4 / GIB
    return {"memory_gib": round(profiles * copy, 2),
            "disk_per_phase_gib": round(profiles * copy * int(train.get("posthoc_snapshots", 8)), 1)}  # fmt: skip


def parallel_state(full: dict[str, Any], unet_params: int | None, gpus: int) -> dict[str, Any] | None:
    """The training state each rank holds (fp32 weights, gradients, AdamW, EMA; before activations), GiB: replicated
    (DDP) and sharded over the pod's ``gpus`` (FSDP); None when the denoiser's size is unknown. docs/PARALLEL.md."""
    if not unet_params:
        return None
    state = replicated_state_bytes(unet_params) / GIB
    setting = full.get("train", {}).get("parallel", "auto")
    return {"ddp_gib": round(state, 2), "fsdp_gib": round(state / max(gpus, 1), 2), "gpus": gpus, "setting": setting}


def full_eval_unet_calls(full: dict[str, Any]) -> int:
    """UNet evaluations of every phase's eval grid (prompts × steps, ×2 with classifier-free guidance)."""
    ev = full.get("eval", {})
    prompts = ev.get("prompts", [])
    categories = prompts.items() if isinstance(prompts, dict) else [("all", prompts)]
    sampling, default_steps = ev.get("sampling") or {}, int(ev.get("steps", 50))
    calls = sum(len(items) * int(sampling.get(c, {}).get("steps", default_steps)) for c, items in categories)
    cfg = 2 if float(ev.get("guidance_scale", 1.0)) > 1.0 else 1
    return calls * cfg * len(full.get("phases", {}))


def _rate(work: float, seconds: float) -> float | None:
    return work / seconds if seconds > 0 and work > 0 else None


def _hours(work: float | None, rate: float | None) -> float | None:
    return work / rate / 3600 if work and rate else None


def _train_rate(runs: list[StageRun]) -> float | None:
    """Samples per second over the measured steps (the first of each phase dropped when there are more)."""
    samples = seconds = 0.0
    for run in runs:
        for step_s, step_samples in run.steps[1:] if len(run.steps) > 1 else run.steps:
            samples += step_samples
            seconds += step_s
    return _rate(samples, seconds)


def _encode_rate(runs: list[StageRun]) -> float | None:
    images = sum(float(r.metrics.get("images_encoded", 0)) for r in runs)
    seconds = sum(
        float(r.metrics["images_encoded"]) / float(r.metrics["images_per_second"])
        for r in runs
        if r.metrics.get("images_per_second")
    )
    return _rate(images, seconds)


def forecast(
    runs: list[StageRun], full: dict[str, Any], preflight: dict[str, Any], pod: Pod, cpus: int = 2
) -> tuple[list[Row], dict[str, Any]]:
    """The forecast rows (one per stage type, in run order) and the full run's totals (``cpus``: this device's)."""
    by_kind: dict[str, list[StageRun]] = {}
    for run in runs:
        by_kind.setdefault(run_kind(run, full), []).append(run)
    images = sum(full_images(full).values())
    rows = [_row(kind, kind_runs, full, preflight, pod, images, cpus) for kind, kind_runs in by_kind.items()]
    rows += [row] if (row := coco_row(by_kind.get("eval_grid", []), full, pod)) else []
    device_h = sum(r.device_hours or 0 for r in rows)
    pod_h = sum(r.pod_hours or 0 for r in rows)
    totals = {
        "full_images_fetched": images,
        "full_train_samples": full_train_samples(full),
        "full_optimizer_steps": full_optimizer_steps(full, pod.gpus),
        "device_hours": round(device_h, 2),
        "device_days": round(device_h / 24, 2),
        "pod_hours": round(pod_h, 2),
        "pod_gpu_hours": round(pod_h * pod.gpus, 1),
        "pod_cost": round(pod_h * pod.gpus * pod.price_per_gpu_hour, 0),
        "pod": asdict(pod),
        "peak_rss_gib": round(max((r.peak_rss_bytes for r in runs), default=0) / GIB, 2),
    }
    forwards = full_val_loss_forwards(full, pod.gpus)
    totals["val_loss_forwards"] = forwards
    totals["val_loss_pod_hours"] = round(forwards / (3 * pod.train_img_s) / 3600, 2)  # one GPU; forward ~3x a step
    unet_params = next((int(r.metrics["unet_params"]) for r in runs if r.metrics.get("unet_params")), None)
    totals["posthoc_ema"] = posthoc_ema_cost(full, unet_params)
    totals["parallel_state"] = parallel_state(full, unet_params, pod.gpus)
    return rows, totals


def _row(kind: str, runs: list[StageRun], full: dict, preflight: dict, pod: Pod, images: int, cpus: int) -> Row:
    row = Row(
        stage=kind,
        runs=len(runs),
        wall_s=round(sum(r.wall_s for r in runs), 1),
        peak_rss_gib=round(max(r.peak_rss_bytes for r in runs) / GIB, 2),
    )
    if kind in FIXED:
        row.note = "fixed: does not scale with the sample"
    elif kind == "fetch_images":
        rate = pod.fetch_img_s * min(1.0, cpus / 16)
        _project(row, rate, "img/s", images, pod.fetch_img_s, "assumed rates (network-bound; not measured)")
    elif kind == "encode_latents":
        _project(row, _encode_rate(runs), "img/s", images, pod.encode_img_s * pod.gpus, "")
    elif kind == "train":
        work = full_train_samples(full, distill=False)
        _project(row, _train_rate(runs), "img/s", work, pod.train_img_s * pod.gpus, "")
    elif kind == TRAIN_DISTILL:
        work = full_train_samples(full, distill=True)
        _project(row, _train_rate(runs), "img/s", work, pod.train_img_s * pod.gpus / 2,
                 "pod rate assumed half training's (3 more UNet forwards per sample)")  # fmt: skip
    elif kind == "caption_images":
        _caption_row(row, runs, full)
    elif kind == "eval_grid":
        calls = full_eval_unet_calls({"eval": preflight.get("eval", {}), "phases": {"one": {}}}) * len(runs)
        rate = _rate(calls, row.wall_s)
        _project(row, rate, "UNet calls/s", full_eval_unet_calls(full), 3 * pod.train_img_s * pod.gpus,
                 "pod rate assumed 3x training's")
    return row


def coco_row(runs: list[StageRun], full: dict[str, Any], pod: Pod) -> Row | None:
    """``eval_coco``: the COCO protocol at every phase end, in UNet calls (``eval.coco.phase_end_samples`` × phases ×
    steps × 2 with CFG), at the rate measured in the preflight (its own steps and guidance, from the metrics; the
    scoring counted in the time); on the pod at the eval grid's assumed rate (3 × training's). None when the full
    run does not evaluate COCO at phase ends or the preflight did not."""
    measured = [r for r in runs if r.metrics.get("coco_samples")]
    coco = full.get("eval", {}).get("coco") or {}
    if not measured or not coco.get("phase_end_samples"):
        return None
    seconds = sum(float(r.metrics["coco_seconds"]) for r in measured)
    row = Row(stage="eval_coco", runs=len(measured), wall_s=round(seconds, 1),
              peak_rss_gib=round(max(r.peak_rss_bytes for r in measured) / GIB, 2))  # fmt: skip
    done = sum(float(r.metrics["coco_samples"]) * _calls(r.metrics["coco_steps"], r.metrics["coco_guidance_scale"])
               for r in measured)  # fmt: skip
    ev = full.get("eval", {})
    guidance = coco.get("guidance_scale") or ev.get("guidance_scale", 7.5)
    per_image = _calls(coco.get("steps") or ev.get("steps", 50), guidance)
    work = int(coco["phase_end_samples"]) * coco_phases(full) * per_image
    note = f"{coco['phase_end_samples']:,} captions x phases x {per_image} UNet calls; pod rate assumed 3x training's"
    _project(row, _rate(done, seconds), "UNet calls/s", work, 3 * pod.train_img_s * pod.gpus, note)
    return row


def coco_phases(full: dict[str, Any]) -> int:
    """The phases whose eval grid runs the COCO protocol: those sampled (``eval_grid`` not false) that are not
    ControlNet phases (:func:`sdforge.eval.coco.phase_end_samples`)."""
    return sum(1 for p in full.get("phases", {}).values() if p.get("eval_grid", True) and not p.get("controlnet"))


def _calls(steps: float, guidance: float) -> int:
    """UNet evaluations per image: ``steps``, twice with classifier-free guidance."""
    return int(steps) * (2 if float(guidance) > 1 else 1)


def _caption_row(row: Row, runs: list[StageRun], full: dict) -> None:
    """``caption_images``: the full run's images of recaptioned sources at the measured captioning rate; no pod
    rate is assumed (none was measured on a GPU)."""
    recaptioned = {n for n, s in full.get("sources", {}).items() if s.get("recaption")}
    enabled = [r for r in runs if r.metrics.get("enabled")]
    if not recaptioned or not enabled:
        row.note = "fixed: no source has recaption"
        return
    seconds = sum(float(r.metrics.get("seconds", 0)) for r in enabled)
    rate = _rate(sum(float(r.metrics.get("run.captioned", 0)) for r in enabled), seconds)
    work = sum(n for name, n in full_images(full).items() if name in recaptioned)
    _project(row, rate, "img/s", work, None, "pod rate not measured: hours at this device's rate")


def _project(row: Row, rate: float | None, unit: str, work: float, pod_rate: float | None, note: str) -> None:
    row.rate = round(rate, 4) if rate else None
    row.unit, row.full_work, row.note = unit, work, note
    row.device_hours = _hours(work, rate)
    row.pod_hours = _hours(work, pod_rate if pod_rate else rate)
    for name in ("device_hours", "pod_hours"):
        value = getattr(row, name)
        setattr(row, name, round(value, 2) if value is not None else None)


def table(rows: list[Row], totals: dict[str, Any], device: str) -> str:
    """The forecast as a Markdown table with a totals line."""
    pod = totals["pod"]
    head = (
        f"| stage | runs | wall s | peak RSS GiB | rate on {device} | full-run work | hours on {device} "
        f"| hours on {pod['gpus']}× {pod['name']} | note |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        rate = f"{r.rate:g} {r.unit}" if r.rate else "—"
        work = f"{r.full_work:,.0f}" if r.full_work else "—"
        lines.append(
            f"| {r.stage} | {r.runs} | {r.wall_s:g} | {r.peak_rss_gib:g} | {rate} | {work} | "
            f"{_fmt(r.device_hours)} | {_fmt(r.pod_hours)} | {r.note} |"
        )
    lines.append(
        f"\nfull run: {totals['full_train_samples']:,} training samples, {totals['full_optimizer_steps']:,} "
        f"optimizer steps on {pod['gpus']} GPUs; {totals['device_days']} days on {device}; "
        f"{totals['pod_hours']} h on the pod = {totals['pod_gpu_hours']} GPU-hours ≈ "
        f"${totals['pod_cost']:,.0f} at ${pod['price_per_gpu_hour']}/GPU-hour (assumed figures, not measured)"
    )
    lines.append(
        f"validation loss: {totals.get('val_loss_forwards', 0):,} held-out forward passes ≈ "
        f"{totals.get('val_loss_pod_hours', 0)} h on the main GPU (the others wait; assumed 3x the training rate)"
    )
    posthoc = totals.get("posthoc_ema")
    lines.append("post-hoc EMA: off" if not posthoc else
                 f"post-hoc EMA: {posthoc['memory_gib']} GiB more per rank (tracked EMAs, fp32), "
                 f"{posthoc['disk_per_phase_gib']} GiB of snapshots per phase in the run dir")  # fmt: skip
    state = totals.get("parallel_state")
    if state:
        lines.append(f"training state per rank (fp32 weights, gradients, AdamW, EMA; before activations): DDP "
                     f"{state['ddp_gib']} GiB, FSDP over {state['gpus']} GPUs {state['fsdp_gib']} GiB "
                     f"(train.parallel: {state['setting']}; docs/PARALLEL.md)")  # fmt: skip
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:g}"
