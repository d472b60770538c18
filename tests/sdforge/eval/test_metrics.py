"""CLIP score and FID from local weights: a tiny CLIP trained here for a few steps, and a tiny
TorchScript feature extractor in the NVlabs Inception calling convention."""

from __future__ import annotations

import logging
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from sdforge.eval.metrics import clip_scores, frechet_distance, image_metrics, inception_features
from tests.fixtures.eval_workspace import tiny_clip_parts, write_channel_means
from tests.fixtures.sources import png_header


@pytest.fixture(scope="module")
def inception_file(tmp_path_factory):
    return write_channel_means(tmp_path_factory.mktemp("inception") / "pt_inception-tiny.pt")


def _images(n: int, seed: int, shift: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.full((16, 16, 3), rng.integers(40, 200, size=3) + shift, dtype=np.uint8) for _ in range(n)]


def test_fid_is_zero_against_itself_and_the_mean_shift_against_a_shifted_set(inception_file, tmp_path):
    images = _images(32, seed=0)
    ref = tmp_path / "reference"
    ref.mkdir()
    for i, img in enumerate(images):
        Image.fromarray(img).save(ref / f"{i:03d}.png")
    model = torch.jit.load(str(inception_file))
    features = inception_features(model, images, batch_size=5)
    assert features.shape == (32, 3) and features.max() < 1.0  # fed 0..255, divided by 255 inside
    assert frechet_distance(features, features) == pytest.approx(0.0, abs=1e-8)
    # every pixel +30: the features move by 30/255 per channel, the covariance stays → FID = 3·(30/255)²
    shifted = _images(32, seed=0, shift=30)
    got = image_metrics(shifted, ["x"] * 32, ["c"] * 32, None, str(inception_file), str(ref), 100)
    assert got["fid"] == pytest.approx(3 * (30 / 255) ** 2, rel=1e-3)
    assert (got["fid_reference_images"], got["fid_reference_skipped"]) == (32, 0)
    same = image_metrics(images, ["x"] * 32, ["c"] * 32, None, str(inception_file), str(ref), 100)
    assert same["fid"] == pytest.approx(0.0, abs=1e-6)


def _with_moments(n: int, mean: np.ndarray, cov: np.ndarray, seed: int) -> np.ndarray:
    """``n`` samples whose sample mean and (N-1) covariance are exactly ``mean`` and ``cov``."""
    x = np.random.default_rng(seed).standard_normal((n, len(mean)))
    x -= x.mean(0)
    x = x @ np.linalg.inv(np.linalg.cholesky(np.cov(x, rowvar=False))).T  # whitened: covariance I
    return x @ np.linalg.cholesky(cov).T + mean


def test_fid_of_two_gaussians_is_their_frechet_distance():
    """Two Gaussians with known moments: ‖μa − μb‖² + Tr(Σa + Σb − 2(Σa Σb)^½), by hand for commuting
    covariances (both diagonal in one rotated basis: (Σa Σb)^½ has eigenvalues √(λa λb))."""
    rotation, _ = np.linalg.qr(np.random.default_rng(7).standard_normal((4, 4)))
    la, lb = np.array([1.0, 2.0, 0.5, 3.0]), np.array([4.0, 0.5, 0.5, 1.0])
    mu_a, mu_b = np.array([0.0, 1.0, -1.0, 2.0]), np.array([1.0, 1.0, 0.0, 0.0])
    a = _with_moments(500, mu_a, rotation @ np.diag(la) @ rotation.T, seed=1)
    b = _with_moments(400, mu_b, rotation @ np.diag(lb) @ rotation.T, seed=2)
    by_hand = ((mu_a - mu_b) ** 2).sum() + (la + lb - 2 * np.sqrt(la * lb)).sum()
    assert by_hand == pytest.approx(6 + 12.5 - 2 * (2 + 1 + 0.5 + 3**0.5), rel=1e-12)  # = 8.0359
    assert frechet_distance(a, b) == pytest.approx(by_hand, rel=1e-9)
    assert frechet_distance(b, a) == pytest.approx(by_hand, rel=1e-9)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-9)


def test_missing_paths_skip_and_name_the_key(tmp_path):
    imgs = _images(2, seed=1)
    got = image_metrics(imgs, ["a", "b"], ["c", "c"], str(tmp_path / "nope"), None, None, 10)
    assert got["clip_score"] is None and got["clip_score_skipped"].startswith("eval.clip_model_path = ")
    assert got["fid_skipped"] == "eval.fid.inception_path is null: fid skipped"
    got = image_metrics(imgs, ["a", "b"], ["c", "c"], None, str(tmp_path / "x.pt"), None, 10)
    assert got["fid_skipped"] == "eval.fid.reference_dir is null: fid skipped"


def test_a_null_key_skips_as_info_and_a_missing_folder_warns(tmp_path, caplog):
    """A null scorer key is the config's choice (the demo's: no warning in `make demo`); a key naming nothing warns."""
    with caplog.at_level(logging.INFO, logger="sdforge.eval.metrics"):
        image_metrics(_images(2, seed=1), ["a", "b"], ["c", "c"], str(tmp_path / "nope"), None, None, 10)
    levels = {r.getMessage().split(" ", 1)[0]: r.levelname for r in caplog.records}
    assert levels == {"eval.clip_model_path": "WARNING", "eval.fid.inception_path": "INFO"}


RED, BLUE = "a red square", "a blue circle"


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    """A tiny CLIPModel + processor trained 60 steps to match a red image with RED and a blue one with BLUE."""
    out = tmp_path_factory.mktemp("clip")
    model, processor = tiny_clip_parts(out)
    images = [Image.fromarray(img) for img in _coloured()]
    batch = processor(text=[RED, BLUE], images=images, return_tensors="pt", padding=True)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(60):
        loss = model(**batch, return_loss=True).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out / "model")
    processor.save_pretrained(out / "model")
    return out / "model"


def _coloured() -> list[np.ndarray]:
    red, blue = np.zeros((16, 16, 3), np.uint8), np.zeros((16, 16, 3), np.uint8)
    red[..., 0], blue[..., 2] = 220, 220
    return [red, blue]


def test_clip_score_is_higher_for_matching_captions(tiny_clip):
    images = _coloured()
    matching = clip_scores(images, [RED, BLUE], tiny_clip)
    swapped = clip_scores(images, [BLUE, RED], tiny_clip)
    assert min(matching) > max(swapped) + 10  # 100·cos: the trained pairs agree, the swapped ones do not
    got = image_metrics(images, [RED, BLUE], ["shapes", "shapes"], str(tiny_clip), None, None, 10)
    assert got["clip_score"] == pytest.approx(np.mean(matching), abs=1e-3)
    assert got["clip_score_shapes"] == got["clip_score"]


def test_a_bomb_and_an_unreadable_file_among_the_reference_images_are_skipped_and_counted(inception_file, tmp_path):
    """Issue 39: every image decode applies the pixel bound from the header first (here PIL's default, as
    ``fetch.max_image_pixels``): a PNG declaring 30000×30000 is not decoded, a broken file not a traceback."""
    ref = tmp_path / "reference"
    ref.mkdir()
    for i, img in enumerate(_images(8, seed=0)):
        Image.fromarray(img).save(ref / f"{i:03d}.png")
    (ref / "bomb.png").write_bytes(png_header(30_000, 30_000, idat=zlib.compress(b"\0" * 30_001 * 64)))
    (ref / "broken.png").write_bytes(b"\x89PNG not really")
    got = image_metrics(_images(8, seed=0), ["x"] * 8, ["c"] * 8, None, str(inception_file), str(ref), 100)
    assert (got["fid_reference_images"], got["fid_reference_skipped"]) == (8, 2)
    assert got["fid"] == pytest.approx(0.0, abs=1e-6)
