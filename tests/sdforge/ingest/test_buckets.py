"""Aspect-ratio buckets: the shapes generated for a resolution, each image's bucket and crop box, and how
much of a non-square image a bucket keeps compared with a square center crop."""

from __future__ import annotations

import numpy as np
import pytest

from sdforge.ingest.buckets import CropPlan, cover_and_crop, generate_buckets, kept_fraction, nearest_bucket, plan
from sdforge.ingest.image_convert import resize, resize_to_bucket

SD512 = generate_buckets(512 * 512)


def test_512_buckets_are_the_known_five():
    assert SD512 == [(384, 640), (448, 576), (512, 512), (576, 448), (640, 384)]
    assert generate_buckets(256 * 256) == [(192, 320), (256, 256), (320, 192)]
    # a wider aspect range adds the next shapes on both sides
    assert generate_buckets(512 * 512, min_aspect=0.4, max_aspect=2.5)[:2] == [(320, 768), (384, 640)]


@pytest.mark.parametrize("area", [256 * 256, 384 * 384, 512 * 512, 768 * 768, 1024 * 1024])
@pytest.mark.parametrize("step", [32, 64])
def test_generated_buckets_fit_the_area_the_step_and_the_aspect_range(area, step):
    buckets = generate_buckets(area, step)
    assert buckets and len(set(buckets)) == len(buckets)
    assert all(w % step == 0 and h % step == 0 for w, h in buckets)
    assert all(w * h <= area for w, h in buckets)
    assert all(0.5 <= w / h <= 2.0 for w, h in buckets)
    side = int(area**0.5)
    assert (side, side) in buckets  # the target's own square
    # each bucket holds most of the target's pixels (the tallest height that fits its width)
    assert min(w * h for w, h in buckets) >= area * 0.75


@pytest.mark.parametrize(
    "size, bucket, resized, box",
    [
        ((1000, 1000), (512, 512), (512, 512), (0, 0, 512, 512)),
        ((1600, 900), (640, 384), (683, 384), (21, 0, 661, 384)),  # 16:9 landscape
        ((900, 1600), (384, 640), (384, 683), (0, 21, 384, 661)),  # 9:16 portrait
        ((640, 480), (576, 448), (597, 448), (10, 0, 586, 448)),  # 4:3
        ((2000, 500), (640, 384), (1536, 384), (448, 0, 1088, 384)),  # 4:1: the widest bucket, cropped
        ((100, 50), (640, 384), (768, 384), (64, 0, 704, 384)),  # upscaled to cover
    ],
)
def test_bucket_and_crop_box_for_a_table_of_sizes(size, bucket, resized, box):
    got = plan(*size, SD512)
    assert got == CropPlan(bucket, resized, box)
    left, top, right, bottom = got.box
    assert (right - left, bottom - top) == bucket  # the box is exactly the bucket
    assert 0 <= left and 0 <= top and right <= resized[0] and bottom <= resized[1]
    # centred: the cut is split evenly (within a pixel) between both sides
    assert abs(left - (resized[0] - right)) <= 1 and abs(top - (resized[1] - bottom)) <= 1


def test_ties_go_to_the_larger_bucket_and_bad_sizes_are_refused():
    assert nearest_bucket(300, 300, [(256, 256), (512, 512)]) == (512, 512)
    with pytest.raises(ValueError, match="positive"):
        nearest_bucket(0, 10, SD512)
    with pytest.raises(ValueError, match="no buckets"):
        nearest_bucket(10, 10, [])
    with pytest.raises(ValueError, match="holds no"):
        generate_buckets(100, 64)
    with pytest.raises(ValueError, match="min_aspect"):
        generate_buckets(512 * 512, min_aspect=1.5)


@pytest.mark.parametrize("size", [(1600, 900), (900, 1600), (640, 480), (2000, 500), (1000, 1000), (750, 1000)])
def test_a_bucket_keeps_at_least_what_a_square_center_crop_keeps(size):
    w, h = size
    square = kept_fraction(w, h, (512, 512))
    assert square == pytest.approx(min(w, h) ** 2 / (w * h), abs=2e-3)
    assert kept_fraction(w, h, nearest_bucket(w, h, SD512)) >= square - 1e-9


def test_kept_fraction_figures():
    assert kept_fraction(1600, 900, (640, 384)) == pytest.approx(640 / 683)  # 94 % vs 56 % square
    assert kept_fraction(1600, 900, (512, 512)) == pytest.approx(0.5625, abs=1e-3)
    assert cover_and_crop(1000, 1000, (512, 512)).resized == (512, 512)


def _x_ramp(width: int, height: int) -> np.ndarray:
    """An RGB image whose red channel encodes the column (0 at the left edge, 255 at the right)."""
    ramp = np.linspace(0, 255, width).round().astype(np.uint8)
    img = np.zeros((height, width, 3), np.uint8)
    img[..., 0] = ramp[None, :]
    img[..., 1] = 128
    return img


def test_resize_to_a_square_bucket_is_exactly_todays_center_crop():
    img = _x_ramp(1600, 900)
    square = resize_to_bucket(img, cover_and_crop(1600, 900, (512, 512)))
    assert np.array_equal(square, resize(img, 512, "center_crop"))


@pytest.mark.parametrize("size", [(1600, 900), (640, 480), (2000, 500), (100, 50)])
def test_resize_to_bucket_gives_the_buckets_shape_and_keeps_the_predicted_columns(size):
    w, h = size
    p = plan(w, h, SD512)
    out = resize_to_bucket(_x_ramp(w, h), p)
    assert out.shape == (p.bucket[1], p.bucket[0], 3)
    # the first and last kept columns are the original's columns at the crop box's edges
    scale = p.resized[0] / w
    for col, x in ((0, p.box[0]), (-1, p.box[2] - 1)):
        want = 255 * min(w - 1, (x + 0.5) / scale - 0.5) / (w - 1)
        assert abs(int(out[h // 4 if h > 4 else 0, col, 0]) - want) <= 255 * 2 / scale / (w - 1) + 3
