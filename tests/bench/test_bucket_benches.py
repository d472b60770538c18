"""Issue 18's benches (latent_loader with buckets, bucket_step, data_kept): their pure parts and small smoke runs.

Values only; no timing is asserted."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from bench import bucket_step, data_kept, latent_loader

# ------------------------------------------------------------------------------------- data_kept


def test_square_crop_keeps_the_short_side_squared_and_buckets_keep_more_of_a_16_9_image():
    assert data_kept.square_kept(1920, 1080) == pytest.approx(0.5625)
    assert data_kept.square_kept(1080, 1920) == pytest.approx(0.5625)
    assert data_kept.bucket_kept(1920, 1080) > 0.9  # 640x384 (5:3) of a 16:9 image: 0.9375
    assert data_kept.bucket_kept(1920, 1080) == pytest.approx(0.9375, abs=1e-3)
    assert data_kept.bucket_kept(700, 700) == data_kept.square_kept(700, 700) == 1.0
    assert data_kept.SD_BUCKETS == [(384, 640), (448, 576), (512, 512), (576, 448), (640, 384)]


def test_fixture_is_seeded_and_follows_the_class_mix():
    images = data_kept.fixture(2000, seed=0)
    assert images == data_kept.fixture(2000, seed=0) and images != data_kept.fixture(2000, seed=1)
    shares = {c: sum(i.cls == c for i in images) / len(images) for c in data_kept.CLASSES}
    for cls, (_, _, share) in data_kept.CLASSES.items():
        assert shares[cls] == pytest.approx(share, abs=0.03)
    for i in images:
        a, b, _ = data_kept.CLASSES[i.cls]
        assert 256 <= min(i.width, i.height) <= 3000
        assert i.width / i.height == pytest.approx(a / b, rel=0.01)


def test_summary_means_per_class_and_overall():
    table = data_kept.summarise(data_kept.fixture(500, seed=0))
    assert list(table)[-1] == "all" and sum(k.images for n, k in table.items() if n != "all") == 500
    assert table["1:1"].square_image == table["1:1"].bucket_image == 1.0
    assert table["16:9"].square_image == pytest.approx(0.5625, abs=1e-4)
    assert table["16:9"].bucket_image > 0.9
    assert table["3:1"].square_pixel == pytest.approx(1 / 3, abs=1e-3)
    for k in table.values():
        assert k.bucket_image >= k.square_image - 1e-9 and k.bucket_pixel >= k.square_pixel - 1e-9


@pytest.mark.parametrize("size", [(640, 360), (360, 540), (480, 360), (1080, 360), (300, 300)])
def test_decode_sample_keeps_what_the_plan_says(size):
    got, planned = data_kept.decoded_kept(*size, data_kept.SD_BUCKETS)
    assert got == pytest.approx(planned, abs=1e-12)
    sq_got, sq_planned = data_kept.decoded_kept(*size, data_kept.SQUARE)
    assert sq_got == pytest.approx(sq_planned, abs=1e-12)
    assert sq_got == pytest.approx(data_kept.square_kept(*size), abs=2e-3)  # resize rounding only
    if size == (640, 360):
        assert sq_got == pytest.approx(0.5625, abs=1e-3) and got > 0.9


def test_data_kept_quick_result_line(capsys):
    data_kept.main(["--quick"])
    lines = capsys.readouterr().out.splitlines()
    fields = dict(re.findall(r"(\w+)=(\"[^\"]*\"|\S+)", lines[-1]))
    assert lines[-1].startswith("RESULT name=data_kept ratio=")
    assert fields["images"] == "1000" and fields["decode_checked"] == "9"
    assert float(fields["square_kept_pixel"]) == pytest.approx(0.689, abs=1e-3)
    assert float(fields["bucket_kept_pixel"]) == pytest.approx(0.914, abs=1e-3)
    assert float(fields["ratio"]) == pytest.approx(0.914 / 0.689, abs=5e-3)


# --------------------------------------------------------------------------------- latent_loader


def test_latent_loader_buckets_are_sd_shapes_of_about_64x64_latents():
    assert latent_loader.BUCKETS[0] == (512, 512) and len(set(latent_loader.BUCKETS)) == 8
    for bucket in latent_loader.BUCKETS:
        c, h, w = latent_loader.latent_shape(bucket)
        assert c == 4 and bucket == (w * 8, h * 8)
        assert 3840 <= h * w <= 4096 and 0.5 <= w / h <= 2.0


def test_latent_loader_layout_rows_are_dense_per_shard_and_bucket():
    manifest = latent_loader.layout(10_000, 8)
    assert manifest.height == 10_000 and manifest["key"].n_unique() == 10_000
    assert manifest.select("shard", "bucket_width", "bucket_height").n_unique() == 3 * 8
    for (_, _, _), part in manifest.group_by("shard", "bucket_width", "bucket_height"):
        assert part["row"].to_list() == list(range(part.height))  # 0..n-1 in key order
    counts = np.bincount(latent_loader.sample_buckets(10_000, 8))
    assert counts[0] == counts.max() and counts[-1] == counts.min()  # weight 1/(k+1)
    assert not latent_loader.sample_buckets(100, 1).any()
    with pytest.raises(ValueError):
        latent_loader.sample_buckets(100, 9)


@pytest.mark.parametrize("buckets", [1, 8])
def test_latent_loader_both_designs_serve_the_same_batches(tmp_path, monkeypatch, capsys, buckets):
    monkeypatch.setattr(latent_loader.os, "sync", lambda: None)  # no need to flush the machine's disks here
    root = tmp_path / "data"
    latent_loader.generate(root, 500, buckets)
    done = json.loads((root / "DONE").read_text())
    assert done["layout"] == latent_loader.LAYOUT and done["buckets"] == buckets
    files = latent_loader.design_files(root)
    assert len(files["ours"]) - 1 == (buckets if buckets == 1 else len(set(latent_loader.sample_buckets(500, 8))))
    assert len(files["ref"]) == 500 + 2
    out = {}
    for design in ("ours", "ref"):
        latent_loader.child(design, root)
        out[design] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["ours"]["checksum"] == out["ref"]["checksum"]
    assert out["ours"]["batches"] == out["ref"]["batches"] > 0
    assert out["ours"]["samples"] == 500


# ----------------------------------------------------------------------------------- bucket_step


def test_bucket_step_buckets_have_the_square_latent_area():
    areas = {np.prod(bucket_step.latent_shape(b)[1:]) for b in bucket_step.BUCKETS}
    assert areas == {np.prod(bucket_step.latent_shape(bucket_step.SQUARE)[1:])} == {576}
    assert bucket_step.BUCKETS[0] == bucket_step.SQUARE
    counts = np.bincount(bucket_step.sample_buckets(600))
    assert counts.sum() == 600 and counts[0] > counts[1] > counts[2]


def test_bucket_step_variants_read_the_same_samples_from_their_stores(tmp_path):
    square, buckets = bucket_step.build(48, 4, tmp_path)
    assert square.data.buckets == [bucket_step.SQUARE] and len(square.data) == 48
    assert sorted(buckets.data.buckets) == sorted(bucket_step.BUCKETS) and len(buckets.data) == 48
    for a, b in zip(square.unet.parameters(), buckets.unet.parameters(), strict=True):
        assert torch.equal(a, b)  # same seed-0 weights
    _, latents, ids = square._next()
    assert latents.shape == (4, 4, 24, 24) and ids.shape == (4, 77)
    shapes = {tuple(buckets._next()[1].shape) for _ in range(12)}  # an epoch: 48 samples, full batches of 4
    assert shapes <= {(4, 4, 24, 24), (4, 4, 18, 32), (4, 4, 32, 18)} and len(shapes) >= 2
    buckets.times, buckets.shapes = [0.1, 0.3, 0.2], [(18, 32), (24, 24), (18, 32)]
    assert bucket_step.per_shape(buckets) == {
        "18x32": (2, pytest.approx(150.0)),
        "24x24": (1, pytest.approx(300.0)),
    }
    assert buckets.rate() == pytest.approx(5.0)
