"""The COCO-2014 protocol: zero-shot FID and CLIP score of a checkpoint on COCO validation captions (docs/EVAL.md).

* **Prompts**: the images of ``eval.coco.captions`` (``captions_val2014.json``) with a caption and a safe
  ``file_name``, sorted by id, in the order of a permutation seeded by ``eval.coco.seed``; the first ``samples``
  of them, each with one of its captions drawn with a generator seeded by (seed, image id). So the first 5,000 of
  FID-30k are FID-5k's, in every phase and on every machine.
* **Images**: prompt ``i`` sampled with seed ``eval.coco.seed + i`` by the checkpoint's own sampler at
  ``eval.coco.steps`` / ``guidance_scale`` (default ``eval.steps`` / ``guidance_scale``; a distilled phase: its
  ``distill.sampling_steps`` and guidance 1), negative prompt ``eval.negative_prompt``, at the model's native size.
* **FID** against the same images from ``eval.coco.images`` (``val2014/``), each centre-cropped to a square and
  resized with PIL bicubic to ``eval.coco.reference_size`` (default: the generated side); both sets go to the
  NVlabs Inception as 0..255 floats, which resizes them to 299² (bilinear) itself. A reference image that is
  missing or unreadable is skipped and counted (``coco_reference_skipped``), never silently lost.
* **CLIP score**: ``100 · max(cos, 0)`` of each generated image with its caption, averaged (torchmetrics'
  definition), with the configured scoring CLIP.

Generation and scoring stream in ``eval.batch_size`` chunks: FID-30k never holds 30k images in memory.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from sdforge.bounds import json_docs
from sdforge.bounds.images import ImageRejected, open_bounded
from sdforge.bounds.paths import resolves_inside
from sdforge.config import Eval, InputLimits, Params
from sdforge.eval.grid import captioned_grid
from sdforge.eval.metrics import ClipScorer, frechet_distance, inception_features
from sdforge.eval.sampling import Pipeline, few_step_settings, generate, load_pipeline, pick_device
from sdforge.io import InputError

log = logging.getLogger(__name__)

PREVIEW = 16
"""Generated images shown in the preview grid (the first prompts)."""


@dataclass(frozen=True)
class CocoPrompt:
    """One evaluated COCO image: its id, its file under ``val2014/`` and the caption the model is prompted with."""

    image_id: int
    file_name: str
    caption: str


def select_prompts(captions_file: Path, samples: int, seed: int) -> list[CocoPrompt]:
    """The protocol's first ``samples`` prompts (fewer, with a warning, when the file has fewer usable images)."""
    data = _load(Path(captions_file))
    files = {img["id"]: _relative_name(img.get("file_name")) for img in data.get("images") or []
             if isinstance(img, dict) and isinstance(img.get("id"), int)}  # fmt: skip
    captions: dict[int, list[tuple[int, str]]] = {}
    for ann in data.get("annotations") or []:
        if isinstance(ann, dict) and isinstance(ann.get("caption"), str) and isinstance(ann.get("id"), int):
            captions.setdefault(ann.get("image_id"), []).append((ann["id"], ann["caption"].strip()))
    ids = sorted(i for i in files if files[i] and captions.get(i))
    if not ids:
        raise InputError(f"{captions_file}: no image with a caption and a file name (is it captions_val2014.json?)")
    order = np.random.default_rng(seed).permutation(len(ids))[:samples]
    if len(order) < samples:
        log.warning("%s: %d usable images, fewer than the %d asked: all are used", captions_file, len(order), samples)
    prompts = []
    for k in order.tolist():
        image_id = ids[k]
        caps = sorted(captions[image_id])
        pick = int(np.random.default_rng([seed, image_id]).integers(len(caps)))
        prompts.append(CocoPrompt(image_id, files[image_id], caps[pick][1]))
    return prompts


def _relative_name(name: object) -> str | None:
    """``name`` when it is a relative path inside the images folder (no ``..``, not absolute), else None."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name or name.startswith("/"):
        return None
    return None if ".." in name.split("/") else name


def _load(path: Path) -> dict:
    try:
        data = json_docs.load_file(path, InputLimits())
    except json_docs.JsonLimitError as err:
        raise InputError(f"{path}: COCO captions file over a limit: {err}") from None
    except (OSError, ValueError) as err:
        raise InputError(f"{path}: unreadable COCO captions file ({type(err).__name__}: {err}); "
                         "set eval.coco.captions to captions_val2014.json") from None  # fmt: skip
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a COCO captions file (expected a JSON object)")
    return data


def reference_image(path: Path, size: int) -> np.ndarray:
    """``path`` centre-cropped to a square and resized to ``size``² with PIL bicubic, RGB uint8."""
    img = open_bounded(path)
    side = min(img.size)
    left, top = (img.width - side) // 2, (img.height - side) // 2
    img = img.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(img.convert("RGB"))


@dataclass(frozen=True)
class Scorers:
    """The scoring networks (None: that metric is skipped) and where the reference images are."""

    inception: torch.jit.ScriptModule | None
    clip: ClipScorer | None
    images_dir: Path


def evaluate(pipe: Pipeline, cfg: Eval, prompts: list[CocoPrompt], scorers: Scorers, out_dir: Path) -> dict:
    """Sample ``prompts``, score them, write ``out_dir/coco.json`` (protocol + figures) and ``coco_preview.png``;
    the ``coco_*`` metrics."""
    coco = cfg.coco
    # a distilled phase samples with its few steps and guidance 1, whatever eval/eval.coco say
    steps, guidance = few_step_settings(pipe) or (coco.steps or cfg.steps, coco.guidance_scale or cfg.guidance_scale)
    start = time.perf_counter()
    features, clip, preview, side = [], [], [], 0
    for first in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[first : first + cfg.batch_size]
        images = generate(pipe, [p.caption for p in chunk], negative_prompt=cfg.negative_prompt, steps=steps,
                          guidance_scale=guidance, seeds=[coco.seed + first + i for i in range(len(chunk))],
                          batch_size=cfg.batch_size)  # fmt: skip
        side = int(images[0].shape[0])
        preview += images[: max(0, PREVIEW - len(preview))]
        if scorers.inception is not None:
            features.append(inception_features(scorers.inception, images))
        if scorers.clip is not None:
            clip += scorers.clip.scores(images, [p.caption for p in chunk])
    sampled_s = time.perf_counter() - start
    metrics = {"coco_samples": len(prompts), "coco_steps": steps, "coco_guidance_scale": guidance,
               "coco_image_size": side, "coco_sampling_seconds": round(sampled_s, 2),
               "coco_seconds_per_image": round(sampled_s / max(1, len(prompts)), 4),
               "coco_clip_score": round(float(np.mean(clip)), 4) if clip else None,
               "coco_checkpoint_hash": pipe.checkpoint_hash}  # fmt: skip
    if scorers.inception is not None:
        metrics.update(_fid(np.concatenate(features), prompts, scorers, coco.reference_size or side))
    metrics["coco_seconds"] = round(time.perf_counter() - start, 2)
    _write(out_dir, cfg, prompts, preview, metrics)
    return metrics


def _fid(generated: np.ndarray, prompts: list[CocoPrompt], scorers: Scorers, size: int) -> dict:
    """FID of the generated features against the prompts' own COCO images (streamed, skipped ones counted)."""
    reference, batch, skipped = [], [], 0
    for p in prompts:
        try:
            if not resolves_inside(scorers.images_dir / p.file_name, scorers.images_dir):
                raise OSError("resolves outside eval.coco.images")
            batch.append(reference_image(scorers.images_dir / p.file_name, size))
        except (OSError, ImageRejected) as err:
            log.warning("%s: reference image skipped (%s)", scorers.images_dir / p.file_name, err)
            skipped += 1
        if len(batch) == 32:
            reference.append(inception_features(scorers.inception, batch))
            batch = []
    if batch:
        reference.append(inception_features(scorers.inception, batch))
    count = sum(len(r) for r in reference)
    if count < 2:
        raise InputError(f"eval.coco.images {scorers.images_dir}: {count} of {len(prompts)} reference images "
                         "readable; FID needs at least 2 (is it the val2014/ folder?)")  # fmt: skip
    return {"coco_fid": round(frechet_distance(generated, np.concatenate(reference)), 4),
            "coco_reference_images": count, "coco_reference_skipped": skipped, "coco_reference_size": size}  # fmt: skip


def _write(out_dir: Path, cfg: Eval, prompts: list[CocoPrompt], preview: list[np.ndarray], metrics: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    protocol = {**cfg.coco.model_dump(), "negative_prompt": cfg.negative_prompt, "fid_resize": "centre crop, PIL "
                "bicubic to the reference size; the Inception resizes to 299x299 (bilinear)"}  # fmt: skip
    record = {"protocol": protocol, "metrics": metrics, "first_prompts": [asdict(p) for p in prompts[:PREVIEW]]}
    (out_dir / "coco.json").write_text(json.dumps(record, indent=2) + "\n")
    if preview:
        captions = [p.caption[:60] for p in prompts[: len(preview)]]
        captioned_grid(preview, captions, min(4, len(preview))).save(out_dir / "coco_preview.png")


def load_scorers(params: Params, device: torch.device) -> Scorers:
    """The scoring CLIP and Inception the params name (:meth:`~sdforge.config.Params.eval_clip_path`,
    :meth:`~sdforge.config.Params.fid_inception_path`), on ``device``; one not given or not on disk is None,
    with a warning naming its key."""
    clip_path, inception_path = params.eval_clip_path(), params.fid_inception_path()
    clip = inception = None
    if clip_path and Path(clip_path).is_dir():
        clip = ClipScorer(clip_path, device)
    else:
        log.warning("COCO protocol: no CLIP score (eval.clip_model_path / models.eval_clip: %s is not a folder; run "
                    "`dvc repro prepare_models` with models.eval_clip set)", clip_path)  # fmt: skip
    if inception_path and Path(inception_path).is_file():
        inception = torch.jit.load(str(inception_path), map_location=device).eval()
    else:
        log.warning("COCO protocol: no FID (eval.fid.inception_path / models.fid_inception: %s is not a file)",
                    inception_path)  # fmt: skip
    return Scorers(inception, clip, Path(params.eval.coco.images or "."))


def phase_end_samples(params: Params, phase: str) -> int:
    """The COCO protocol's captions at ``phase``'s end: ``eval.coco.phase_end_samples``, or 0 for a ControlNet phase
    (its UNet is its ``init_from`` phase's, frozen, whose own eval measured it; COCO's captions have no conditions)."""
    if params.phases[phase].controlnet is not None:
        if params.eval.coco.phase_end_samples:
            log.info("COCO protocol skipped for %s: a ControlNet phase (its frozen UNet is %s's, measured there)",
                     phase, params.phases[phase].init_from)  # fmt: skip
        return 0
    return params.eval.coco.phase_end_samples or 0


def run_protocol(params: Params, checkpoint_dir: Path, samples: int, out_dir: Path, device: str = "auto",
                 use_ema: bool = True) -> dict:  # fmt: skip
    """The whole protocol on one phase checkpoint: ``samples`` prompts, their images, FID and CLIP score;
    ``out_dir`` gets ``coco.json`` and ``coco_preview.png``. An InputError when ``eval.coco`` names no files."""
    coco = params.eval.coco
    if not coco.captions or not coco.images:
        raise InputError("eval.coco.captions and eval.coco.images must name captions_val2014.json and the val2014/ "
                         "folder (cocodataset.org) for the COCO protocol")  # fmt: skip
    prompts = select_prompts(Path(coco.captions), samples, coco.seed)
    pipe = load_pipeline(Path(params.paths.models), Path(checkpoint_dir), use_ema=use_ema, device=device)
    scorers = load_scorers(params, pick_device(device))
    metrics = evaluate(pipe, params.eval, prompts, scorers, Path(out_dir))
    log.info("COCO protocol, %d samples of %s: FID %s, CLIP score %s (%.1f s)", len(prompts), checkpoint_dir,
             metrics.get("coco_fid"), metrics.get("coco_clip_score"), metrics["coco_seconds"])  # fmt: skip
    return metrics
