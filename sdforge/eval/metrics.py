"""Image-quality metrics of the eval grid: CLIP score and FID, from local weights only (never a download).

- **CLIP score** (Hessel et al. 2021, as torchmetrics computes it): ``100 · max(cos(img, text), 0)``,
  averaged over (image, prompt) pairs, with a transformers ``CLIPModel`` loaded from a local folder.
- **FID**: Fréchet distance between Gaussians fitted to Inception pool features of the generated and
  the reference images, computed here with ``scipy.linalg.sqrtm`` (no torchmetrics, which would pull
  torchvision). The Inception is the NVlabs TorchScript ``pt_inception-2015-12-05`` file (the TF FID
  network, as clean-fid and StyleGAN use it): called ``model(x, return_features=True)`` on N×3×H×W
  float32 in 0..255; it resizes to 299 itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from sdforge.bounds.images import ImageRejected, open_bounded

log = logging.getLogger(__name__)

NULL = "is null"
"""The reason of a metric skipped because its params key is null (a choice, logged as info)."""
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


class ClipScorer:
    """A transformers ``CLIPModel`` + processor loaded once from a local folder (never a download), on ``device``."""

    def __init__(self, model_path: str | Path, device: torch.device | str = "cpu"):
        # lazy: only when a CLIP score is asked for
        from transformers import CLIPModel, CLIPProcessor

        self.device = torch.device(device)
        self.model = CLIPModel.from_pretrained(model_path, local_files_only=True).eval().to(self.device)
        self.processor = CLIPProcessor.from_pretrained(model_path, local_files_only=True)

    @torch.no_grad()
    def scores(self, images: list[np.ndarray], prompts: list[str], batch_size: int = 16) -> list[float]:
        """Per-image CLIP score ``100 · max(cos, 0)`` of each image with its prompt."""
        out_scores: list[float] = []
        for start in range(0, len(images), batch_size):
            batch = self.processor(
                text=prompts[start : start + batch_size],
                images=[Image.fromarray(img) for img in images[start : start + batch_size]],
                return_tensors="pt",
                padding=True,
                truncation=True,
            ).to(self.device)
            out = self.model(**batch)
            img = torch.nn.functional.normalize(out.image_embeds.float(), dim=-1)
            txt = torch.nn.functional.normalize(out.text_embeds.float(), dim=-1)
            out_scores += (100 * (img * txt).sum(-1).clamp(min=0)).cpu().tolist()
        return out_scores


def clip_scores(
    images: list[np.ndarray], prompts: list[str], model_path: str | Path, batch_size: int = 16
) -> list[float]:
    """Per-image CLIP score ``100 · max(cos, 0)`` of each image with its prompt (model loaded from ``model_path``)."""
    return ClipScorer(model_path).scores(images, prompts, batch_size)


def load_images(folder: str | Path, limit: int) -> tuple[list[np.ndarray], int]:
    """Up to ``limit`` RGB uint8 images from ``folder`` (recursively, sorted by path), each header checked against
    PIL's bomb limit before it is decoded (:func:`~sdforge.bounds.images.open_bounded`); and how many files were
    skipped (too large or unreadable: logged, counted)."""
    files = sorted(f for f in Path(folder).rglob("*") if f.suffix.lower() in IMAGE_SUFFIXES)[:limit]
    images, skipped = [], 0
    for f in files:
        try:
            images.append(np.asarray(open_bounded(f)))
        except ImageRejected as err:
            log.warning("%s: skipped (%s: %s)", f, err.status, err.message)
            skipped += 1
    return images, skipped


@torch.no_grad()
def inception_features(model: torch.nn.Module, images: list[np.ndarray], batch_size: int = 32) -> np.ndarray:
    """``[N, D]`` float64 features; images are fed as N×3×H×W float32 in 0..255 (the NVlabs convention), on the
    model's device."""
    feats = []
    device = next(iter(model.parameters()), torch.empty(0)).device
    for start in range(0, len(images), batch_size):
        x = torch.stack([torch.tensor(np.asarray(i)) for i in images[start : start + batch_size]])
        x = x.permute(0, 3, 1, 2).float().to(device)
        feats.append(model(x, return_features=True).double().cpu().numpy())
    return np.concatenate(feats)


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """``‖μa − μb‖² + Tr(Σa + Σb − 2(ΣaΣb)^½)`` of two ``[N, D]`` feature sets (N ≥ 2 each)."""
    # lazy: scipy (~0.5 s) only when FID runs
    from scipy import linalg

    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"FID needs at least 2 images per set; got {len(a)} and {len(b)}")
    mu_a, mu_b = a.mean(0), b.mean(0)
    sigma_a, sigma_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    covmean = linalg.sqrtm(sigma_a @ sigma_b)
    if not np.isfinite(covmean).all():  # singular product (few images): regularise as pytorch-fid does
        eps = np.eye(len(mu_a)) * 1e-6
        covmean = linalg.sqrtm((sigma_a + eps) @ (sigma_b + eps))
    covmean = covmean.real
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(sigma_a) + np.trace(sigma_b) - 2 * np.trace(covmean))


def fid(images: list[np.ndarray], inception_path: str | Path, reference_dir: str | Path, max_reference: int) -> dict:
    """FID of ``images`` against the images under ``reference_dir``; ``{"fid", "fid_reference_images"}``."""
    reference, skipped = load_images(reference_dir, max_reference)
    if len(reference) < 2:
        raise ValueError(f"eval.fid.reference_dir {reference_dir}: needs at least 2 images; found {len(reference)}")
    model = torch.jit.load(str(inception_path), map_location="cpu").eval()
    value = frechet_distance(inception_features(model, images), inception_features(model, reference))
    return {"fid": round(value, 4), "fid_reference_images": len(reference), "fid_reference_skipped": skipped}


def _skip(metric: str, key: str, why: str) -> dict:
    """``metric`` is ``None`` with its reason; logged as info when the key is null (the config chose no scorer, as
    the demo does), as a warning when the key names something that is not there (a mistake to fix)."""
    reason = f"{key} {why}: {metric} skipped"
    log.log(logging.INFO if why == NULL else logging.WARNING, "%s", reason)
    return {metric: None, f"{metric}_skipped": reason}


def image_metrics(
    images: list[np.ndarray],
    prompts: list[str],
    categories: list[str],
    clip_model_path: str | None,
    inception_path: str | None,
    reference_dir: str | None,
    max_reference: int,
) -> dict:
    """CLIP score (overall and ``clip_score_<category>``) and FID; a metric whose weights are not given
    is ``None`` with a ``<metric>_skipped`` reason that names the params key."""
    out: dict = {}
    if clip_model_path is None:
        out.update(_skip("clip_score", "eval.clip_model_path", NULL))
    elif not Path(clip_model_path).is_dir():
        out.update(_skip("clip_score", "eval.clip_model_path", f"= {clip_model_path} is not a folder"))
    else:
        scores = clip_scores(images, prompts, clip_model_path)
        out["clip_score"] = round(float(np.mean(scores)), 4)
        for cat in dict.fromkeys(categories):
            mine = [s for s, c in zip(scores, categories, strict=True) if c == cat]
            out[f"clip_score_{cat}"] = round(float(np.mean(mine)), 4)
    if inception_path is None:
        out.update(_skip("fid", "eval.fid.inception_path", NULL))
    elif reference_dir is None:
        out.update(_skip("fid", "eval.fid.reference_dir", NULL))
    elif not Path(inception_path).is_file():
        out.update(_skip("fid", "eval.fid.inception_path", f"= {inception_path} is not a file"))
    elif not Path(reference_dir).is_dir():
        out.update(_skip("fid", "eval.fid.reference_dir", f"= {reference_dir} is not a folder"))
    else:
        out.update(fid(images, inception_path, reference_dir, max_reference))
    return out
