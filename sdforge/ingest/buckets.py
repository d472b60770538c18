"""Aspect-ratio buckets: the (width, height) shapes a resolution trains at, which bucket an image goes to,
and how it is resized and cropped into it (issue 18's geometry; no I/O).

A bucket set for a target resolution holds shapes whose sides are multiples of ``step`` (64 px = 8 latent
pixels for SD's VAE), whose area is at most ``max_area`` (the target's, e.g. 512² = 262,144) and whose
aspect ratio (width / height) lies in ``[min_aspect, max_aspect]``. For each width the tallest height that
fits the area is taken (the way kohya's sd-scripts and SimpleTuner build theirs), so every bucket holds
about the target's pixel count.

An image goes to the bucket nearest in aspect ratio (on a log scale, so 1:2 and 2:1 are equally far from
1:1; ties go to the larger bucket). It is resized to *cover* the bucket (both sides at least the bucket's,
aspect kept) and center-cropped to it; the crop box, in the resized image's pixels, is what SDXL-style crop
conditioning records. The crop removes at most the difference between the image's aspect and the bucket's,
so a bucket keeps more of a non-square photo than a square center crop (:func:`kept_fraction`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Size = tuple[int, int]
"""(width, height) in pixels."""


@dataclass(frozen=True)
class CropPlan:
    """How one image becomes a bucket's shape: resize to ``resized`` (aspect kept, covering ``bucket``), then
    crop ``box`` = (left, top, right, bottom) of the resized image."""

    bucket: Size
    resized: Size
    box: tuple[int, int, int, int]


def generate_buckets(max_area: int, step: int = 64, min_aspect: float = 0.5, max_aspect: float = 2.0) -> list[Size]:
    """Every bucket for ``max_area``: widths in multiples of ``step``, each with the tallest multiple-of-``step``
    height whose area fits, kept when its aspect lies in ``[min_aspect, max_aspect]``; sorted by aspect.

    Raises ``ValueError`` for a step, area or aspect range that admits no bucket.
    """
    if step <= 0 or max_area < step * step:
        raise ValueError(f"max_area {max_area} holds no {step}×{step} bucket (step must be > 0)")
    if not 0 < min_aspect <= 1 <= max_aspect:
        raise ValueError(f"need 0 < min_aspect <= 1 <= max_aspect, got {min_aspect}, {max_aspect}")
    found = set()
    for width in range(step, max_area // step + 1, step):
        height = (max_area // width) // step * step
        if height >= step and min_aspect <= width / height <= max_aspect:
            found.add((width, height))
    return sorted(found, key=lambda s: (s[0] / s[1], s[0]))


def shapes_of(bucket_set) -> list[Size]:
    """The buckets of a :class:`sdforge.config.BucketSet` (listed ``sizes``, or generated from ``max_area``,
    ``step`` and the aspect range), sorted by aspect ratio (then width), without duplicates."""
    if bucket_set.sizes is not None:
        return sorted({(int(w), int(h)) for w, h in bucket_set.sizes}, key=lambda s: (s[0] / s[1], s[0]))
    return generate_buckets(bucket_set.max_area, bucket_set.step, bucket_set.min_aspect, bucket_set.max_aspect)


def nearest_bucket(width: int, height: int, buckets: list[Size]) -> Size:
    """The bucket whose aspect ratio is nearest the image's (log distance; ties: the larger area)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}×{height}")
    if not buckets:
        raise ValueError("no buckets to choose from")
    aspect = math.log(width / height)
    return min(buckets, key=lambda b: (round(abs(math.log(b[0] / b[1]) - aspect), 12), -b[0] * b[1]))


def cover_and_crop(width: int, height: int, bucket: Size) -> CropPlan:
    """Resize ``width``×``height`` (aspect kept) to the smallest size covering ``bucket``, then center-crop."""
    bw, bh = bucket
    scale = max(bw / width, bh / height)
    resized = (max(bw, round(width * scale)), max(bh, round(height * scale)))
    left, top = (resized[0] - bw) // 2, (resized[1] - bh) // 2
    return CropPlan(bucket, resized, (left, top, left + bw, top + bh))


def plan(width: int, height: int, buckets: list[Size]) -> CropPlan:
    """The nearest bucket of an image and how it is resized and cropped into it."""
    return cover_and_crop(width, height, nearest_bucket(width, height, buckets))


def kept_fraction(width: int, height: int, bucket: Size) -> float:
    """The fraction of the original image's area that survives the crop into ``bucket`` (1.0: nothing cut).

    A square center crop is ``bucket = (s, s)``: it keeps ``min(w, h)² / (w·h)``.
    """
    p = cover_and_crop(width, height, bucket)
    return (bucket[0] * bucket[1]) / (p.resized[0] * p.resized[1])
