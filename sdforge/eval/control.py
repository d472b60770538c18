"""A ControlNet phase's controllability, measured as ControlNet++ (Li et al. 2024) does: each of the phase's first
``eval.control_samples`` held-out samples is drawn under its own condition and caption, with the ControlNet and
without it (the base: the same UNet, prompt and seed), and scored (docs/CONTROL.md):

- ``controlnet.canny_f1`` (``_base``): the binary F1 between the condition and the Canny edges re-extracted from the
  image with the condition's own thresholds (:func:`sdforge.control.edges.edge_f1`), averaged;
- for demo captions, the probe's colour and shape agreement (``controlnet.shape_agreement``, ``_base``) and the
  placement score ``controlnet.placement_iou`` (``_base``): the median IoU of the drawn shape's mask with the
  condition's filled outline;
- the same agreements on the samples' own latents decoded (``controlnet.shape_agreement_decoded``, ...): what a
  denoiser that drew each latent exactly would score, the ceiling the VAE sets.

Output ``<eval>/<phase>/controlnet.json`` (the figures and every sample's), ``controlnet/NN_{condition,controlnet,
base,decoded}.png`` and ``strips/controlnet.png`` (condition, image, base image per row).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image

from model.sampler import decode_to_uint8
from sdforge.config import DemoData, Eval, Params
from sdforge.control.edges import canny_edges, edge_f1, filled_outline, mask_iou
from sdforge.control.reader import condition_reader
from sdforge.demo.shapes import foreground_mask, parse_caption
from sdforge.eval.grid import captioned_grid, probe_agreement
from sdforge.eval.sampling import Pipeline, generate
from sdforge.io import InputError, held_out_path, write_json
from sdforge.latents.loader import LatentIndexDataset
from sdforge.latents.store import MANIFEST, resolution_dir

log = logging.getLogger(__name__)

CONTROL_DIR, CONTROL_FILE = "controlnet", "controlnet.json"


@dataclasses.dataclass(frozen=True)
class HeldOutControl:
    """One held-out sample's caption, condition (``bool [H, W]`` at its bucket's size) and latent (``[C, h, w]``,
    scaled as stored; None where not read)."""

    source: str
    key: str
    caption: str
    edges: np.ndarray
    latent: torch.Tensor | None = None


def held_out_controls(params: Params, phase: str, count: int) -> list[HeldOutControl]:
    """The first ``count`` held-out samples of ``phase`` that have a condition, with their captions; an InputError
    naming the keys to set when the phase holds none out."""
    held = held_out_path(Path(params.paths.mixes) / f"{phase}.parquet")
    if not holds_samples(held):
        raise InputError(f"eval_grid@{phase}: a ControlNet phase is scored on its held-out samples' conditions and "
                         f"captions; set train.held_out > 0 and re-run mix_phase@{phase}")  # fmt: skip
    return index_controls(params, phase, held, count)


def holds_samples(index: Path) -> bool:
    """Whether the mix index (or held-out index) ``index`` exists and has a row."""
    return index.is_file() and pq.read_metadata(index).num_rows > 0


def index_controls(params: Params, phase: str, index: Path, count: int) -> list[HeldOutControl]:
    """The first ``count`` samples of ``phase``'s mix index ``index`` (its held-out samples', or its training
    samples') that have a condition, with their captions."""
    latents, resolution = Path(params.paths.latents), params.phase_resolution(phase)
    data = LatentIndexDataset(index, latents, resolution)
    reader = condition_reader(params, phase, data)
    keys = pq.read_table(index, columns=["source", "key"]).to_pylist()
    captions = _captions(latents, resolution, sorted({row["source"] for row in keys}))
    out = []
    for position, row in enumerate(keys):
        missing = reader.missing
        edges = reader.gather(np.array([position]))[0, 0].numpy() > 0.5
        if reader.missing == missing:
            caption, latent = captions[row["source"], row["key"]], data.gather(np.array([position]))[0][0]
            out.append(HeldOutControl(row["source"], row["key"], caption, edges, latent))
        if len(out) == count:
            break
    return out


def _captions(latents: Path, resolution: str, sources: list[str]) -> dict[tuple[str, str], str]:
    """Every sample's caption by ``(source, key)``, from the sources' latent manifests."""
    out = {}
    for source in sources:
        table = pq.read_table(resolution_dir(latents, source, resolution) / MANIFEST, columns=["key", "caption"])
        out.update({(source, key): caption for key, caption in zip(*table.to_pydict().values(), strict=True)})
    return out


def evaluate_control(pipe: Pipeline, controls: list[HeldOutControl], cfg: Eval, thresholds: dict, demo: DemoData,
                     out_dir: Path) -> dict:  # fmt: skip
    """Draw each held-out sample with ``pipe`` (a ControlNet phase's) under its condition and with its base, score
    both, write the images, the strip and ``controlnet.json``; the figures (``controlnet.*``)."""
    base = dataclasses.replace(pipe, unet=pipe.denoiser, controlnet=None)
    rows = [_scored(pipe, base, i, control, cfg, thresholds, demo) for i, control in enumerate(controls)]
    (out_dir / CONTROL_DIR).mkdir(parents=True, exist_ok=True)
    decoded = decoded_latents(pipe, controls, out_dir / CONTROL_DIR)
    cells, captions = [], []
    for i, (control, row) in enumerate(zip(controls, rows, strict=True)):
        images = (condition_rgb(control.edges), row.pop("image"), row.pop("base_image"))
        for name, image in zip(("condition", "controlnet", "base"), images, strict=True):
            Image.fromarray(image).save(out_dir / CONTROL_DIR / f"{i:02d}_{name}.png")
        cells += images
        captions += ["condition", f"F1 {row['canny_f1']:.2f}: {control.caption}", f"base F1 {row['canny_f1_base']:.2f}"]
    figures = _summary(rows, [c.caption for c in controls], cells, demo)
    if decoded:
        figures.update(_agreement([image for _, image in decoded], [controls[i].caption for i, _ in decoded], demo,
                                  "_decoded"))  # fmt: skip
    captioned_grid(cells, captions, 3).save(out_dir / "strips" / "controlnet.png")
    write_json(out_dir / CONTROL_FILE, {**figures, "per_sample": rows})
    return figures


def _scored(pipe: Pipeline, base: Pipeline, i: int, control: HeldOutControl, cfg: Eval, thresholds: dict,
            demo: DemoData) -> dict:  # fmt: skip
    """One held-out sample drawn with and without the ControlNet (seed ``eval.seed + i``), and its scores."""
    height, width = control.edges.shape
    kwargs = {"negative_prompt": cfg.negative_prompt, "steps": cfg.steps, "guidance_scale": cfg.guidance_scale,
              "seeds": [cfg.seed + i], "width": width, "height": height}  # fmt: skip
    image = generate(pipe, [control.caption], control_images=[condition_rgb(control.edges)], **kwargs)[0]
    base_image = generate(base, [control.caption], **kwargs)[0]
    row = {"source": control.source, "key": control.key, "caption": control.caption, "image": image,
           "base_image": base_image}  # fmt: skip
    for suffix, drawn in (("", image), ("_base", base_image)):
        row[f"canny_f1{suffix}"] = round(edge_f1(control.edges, canny_edges(drawn, **thresholds)), 6)
        if _is_demo(control.caption):
            row[f"placement_iou{suffix}"] = round(mask_iou(foreground_mask(drawn), filled_outline(control.edges)), 6)
    return row


def _summary(rows: list[dict], captions: list[str], cells: list[np.ndarray], demo: DemoData) -> dict:
    """The means (F1), medians (placement) and probe agreements over the samples, ``controlnet.``-prefixed."""
    out = {"controlnet.samples": len(rows)}
    for suffix in ("", "_base"):
        out[f"controlnet.canny_f1{suffix}"] = _rounded(np.mean([r[f"canny_f1{suffix}"] for r in rows]))
        placed = [r[f"placement_iou{suffix}"] for r in rows if f"placement_iou{suffix}" in r]
        out[f"controlnet.placement_iou{suffix}"] = _rounded(np.median(placed)) if placed else None
    for suffix, images in (("", cells[1::3]), ("_base", cells[2::3])):
        out.update(_agreement(images, captions, demo, suffix))
    return out


def _agreement(images: list[np.ndarray], captions: list[str], demo: DemoData, suffix: str) -> dict:
    """``controlnet.{colour,shape}_agreement<suffix>``: the probe's agreements (None without demo captions)."""
    probe = probe_agreement(images, captions, demo)
    return {f"controlnet.{what}{suffix}": probe.get(what) if probe.get("probe_prompts") else None
            for what in ("colour_agreement", "shape_agreement")}  # fmt: skip


def decoded_latents(pipe: Pipeline, controls: list[HeldOutControl], out_dir: Path) -> list[tuple[int, np.ndarray]]:
    """``(i, image)`` of each control that has its latent, decoded by ``pipe``'s VAE and written as
    ``NN_decoded.png``: what the phase was trained to draw, as far as the VAE can show it."""
    out = []
    for i, control in enumerate(controls):
        if control.latent is not None:
            image = decode_to_uint8(pipe.vae, control.latent[None].to(pipe.vae.device))[0].numpy()
            Image.fromarray(image).save(out_dir / f"{i:02d}_decoded.png")
            out.append((i, image))
    return out


def _rounded(value) -> float | None:
    return None if value is None or np.isnan(value) else round(float(value), 6)


def condition_rgb(edges: np.ndarray) -> np.ndarray:
    """An edge map as the RGB uint8 image a ControlNet pipeline reads (white edges on black)."""
    return np.repeat((edges * 255).astype(np.uint8)[..., None], 3, axis=2)


def _is_demo(caption: str) -> bool:
    try:
        parse_caption(caption)
    except ValueError:
        return False
    return True
