"""The scoring networks' weights, fetched once by ``prepare_models`` into ``${paths.models}`` (pinned by DVC with the
frozen VAE and text encoder), so that no eval ever downloads: ``models.eval_clip`` → ``eval_clip/`` (a transformers
``CLIPModel`` + processor, ``from_pretrained`` from the hub or a local folder) and ``models.fid_inception`` →
``fid_inception.pt`` (the NVlabs TorchScript Inception, from a URL or a local file, its SHA-256 checked when
``models.fid_inception_sha256`` is given). With ``models.missing_weights: random`` (the preflight) a network not on
this machine is a seeded stand-in (:mod:`sdforge.architectures.scorers`)."""

from __future__ import annotations

import hashlib
import logging
import shutil
import urllib.request
from pathlib import Path

import torch

from sdforge.architectures.scorers import build_random_clip, write_inception_stand_in
from sdforge.config import EVAL_CLIP_DIR, FID_INCEPTION_FILE, ConfigError, Models

log = logging.getLogger(__name__)

DOWNLOAD_TIMEOUT_S = 300


def prepare_eval_weights(models: Models, out: Path) -> dict:
    """Write the configured scoring networks under ``out``; metrics ``eval_clip_weights`` / ``fid_inception_weights``
    (``pretrained`` or ``random``), ``fid_inception_sha256`` and ``fid_features`` (the feature width)."""
    metrics: dict = {}
    if models.eval_clip:
        metrics["eval_clip_weights"] = save_clip(models, out / EVAL_CLIP_DIR)
    if models.fid_inception:
        metrics.update(copy_inception(models, out / FID_INCEPTION_FILE))
    return metrics


def save_clip(models: Models, folder: Path) -> str:
    """``models.eval_clip``'s CLIPModel and processor saved to ``folder``; ``pretrained`` or ``random``."""
    # lazy: transformers' CLIPModel only when a scoring CLIP is configured
    from transformers import CLIPModel, CLIPProcessor

    local_only = models.missing_weights == "random"
    try:
        model = CLIPModel.from_pretrained(models.eval_clip, local_files_only=local_only)
        processor = CLIPProcessor.from_pretrained(models.eval_clip, local_files_only=local_only)
    except (OSError, ValueError) as err:
        if not local_only:
            why = f"cannot load {models.eval_clip!r} with from_pretrained: {err}"
            raise ConfigError(f"models.eval_clip: {why}") from err
        log.warning("models.eval_clip: %r is not on this machine (%s): random weights (preflight only)",
                    models.eval_clip, err)  # fmt: skip
        build_random_clip(models.eval_clip, models.seed, folder)
        return "random"
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    return "pretrained"


def copy_inception(models: Models, path: Path) -> dict:
    """``models.fid_inception`` (URL or file) copied to ``path``, checked to load and give features."""
    source = models.fid_inception
    is_url = source.startswith(("http://", "https://"))
    if not is_url and not Path(source).is_file():
        if models.missing_weights != "random":
            raise ConfigError(f"models.fid_inception: {source} is not a file (give a local file or a URL)")
    if models.missing_weights == "random" and (is_url or not Path(source).is_file()):
        log.warning("models.fid_inception: %s is not on this machine: a random stand-in (preflight only)", source)
        write_inception_stand_in(path, models.seed)
        weights = "random"
    else:
        _download(source, path) if is_url else shutil.copyfile(source, path)
        weights = "pretrained"
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if models.fid_inception_sha256 and weights == "pretrained" and digest != models.fid_inception_sha256:
        want = models.fid_inception_sha256
        raise ConfigError(f"models.fid_inception: {source} has SHA-256 {digest}, not models.fid_inception_sha256 "
                          f"{want}: a different file (re-download, or update the hash)")  # fmt: skip
    return {"fid_inception_weights": weights, "fid_inception_sha256": digest, "fid_features": _feature_width(path)}


def _download(url: str, path: Path) -> None:
    tmp = path.with_suffix(".part")
    log.info("models.fid_inception: downloading %s", url)
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response, tmp.open("wb") as f:  # noqa: S310
            shutil.copyfileobj(response, f)
    except OSError as err:
        raise ConfigError(f"models.fid_inception: cannot download {url}: {err} (or give a local file)") from err
    tmp.replace(path)


def _feature_width(path: Path) -> int:
    """Load the TorchScript file and run two images through it: its feature width (a ConfigError if it fails)."""
    try:
        model = torch.jit.load(str(path), map_location="cpu").eval()
        with torch.no_grad():
            features = model(torch.full((2, 3, 64, 64), 128.0), return_features=True)
    except Exception as err:  # noqa: BLE001 - any failure to load or call is the file's fault: one line
        raise ConfigError(f"models.fid_inception: {path} is not a TorchScript model called as "
                          f"model(x, return_features=True): {type(err).__name__}: {err}") from None  # fmt: skip
    return int(features.shape[-1])
