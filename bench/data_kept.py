"""Benchmark: the fraction of an image's pixels that reaches the latents, aspect-ratio buckets vs a square center crop.

``python -m bench.data_kept [--quick] [--images N] [--seed S]``

Issue 18's acceptance: "data kept: on a fixture of mixed aspect ratios, the fraction of original pixels
that reaches the latents, square center-crop vs buckets (report both)". No timing: both sides are
deterministic geometry.

- Fixture (:func:`fixture`): ``--images`` seeded image sizes (5,000; ``--quick`` 1,000) in a LAION/COCO-like
  mix of aspect classes (:data:`CLASSES`: 1:1 25 %, 4:3 20 %, 3:2 17 %, 16:9 14 %, 3:4 8 %, 2:3 8 %,
  9:16 4 %, and the extremes 3:1 and 1:3 2 % each), shorter side log-normal around 700 px (256–3000).
- Baseline, square center crop (the encoder before buckets): keeps ``min(w, h)² / (w·h)``.
- Ours, buckets: SD's 512² set, ``generate_buckets(512 * 512, 64, 0.5, 2.0)`` (384×640, 448×576, 512×512,
  576×448, 640×384); an image keeps ``kept_fraction(w, h, plan(w, h, buckets).bucket)``: resized to cover
  its nearest-aspect bucket, the overhang cropped.
- Through the real code (:func:`decoded_kept`): a JPEG per aspect class (and the square bucket for the
  baseline) goes through :func:`sdforge.latents.inputs.decode_sample`; the fraction computed from the
  returned ``bucket`` and ``resized_to`` (bucket area / resized area) must equal the planned one, the
  decoded image must have the bucket's shape (checked; the bench fails otherwise).

Means are reported per image and pixel-weighted (Σ kept pixels / Σ pixels), per aspect class and overall.
Last line: ``RESULT name=data_kept ratio=<buckets ÷ square, pixel-weighted overall> ...``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from bench._common import machine, result_line
from sdforge.ingest.buckets import Size, generate_buckets, kept_fraction, plan
from sdforge.latents.inputs import decode_sample

CLASSES: dict[str, tuple[int, int, float]] = {
    "1:1": (1, 1, 0.25),
    "4:3": (4, 3, 0.20),
    "3:2": (3, 2, 0.17),
    "16:9": (16, 9, 0.14),
    "3:4": (3, 4, 0.08),
    "2:3": (2, 3, 0.08),
    "9:16": (9, 16, 0.04),
    "3:1": (3, 1, 0.02),
    "1:3": (1, 3, 0.02),
}
"""Aspect class → (width part, height part, share of the fixture)."""
SD_BUCKETS: list[Size] = generate_buckets(512 * 512, 64, 0.5, 2.0)
SQUARE: list[Size] = [(512, 512)]


@dataclass(frozen=True)
class Image:
    """One fixture entry: its aspect class and size in pixels."""

    cls: str
    width: int
    height: int


def size_of(cls: str, short: int) -> tuple[int, int]:
    """(width, height) of an image of aspect class ``cls`` whose shorter side is ``short``."""
    a, b, _ = CLASSES[cls]
    return (round(short * a / b), short) if a >= b else (short, round(short * b / a))


def fixture(n: int, seed: int = 0) -> list[Image]:
    """``n`` seeded image sizes: classes drawn by share, shorter side log-normal around 700 px (256–3000)."""
    rng = np.random.default_rng(seed)
    names = list(CLASSES)
    shares = np.array([CLASSES[c][2] for c in names])
    picks = rng.choice(len(names), size=n, p=shares / shares.sum())
    shorts = np.clip(np.round(rng.lognormal(np.log(700), 0.4, size=n)), 256, 3000).astype(int)
    return [Image(names[c], *size_of(names[c], int(s))) for c, s in zip(picks.tolist(), shorts.tolist(), strict=True)]


def square_kept(width: int, height: int) -> float:
    """A square center crop keeps ``min(w, h)² / (w·h)``."""
    return min(width, height) ** 2 / (width * height)


def bucket_kept(width: int, height: int, buckets: list[Size] = SD_BUCKETS) -> float:
    """The fraction kept by the nearest bucket's cover-and-crop."""
    return kept_fraction(width, height, plan(width, height, buckets).bucket)


@dataclass(frozen=True)
class Kept:
    """Means of one group: per image and pixel-weighted, square and buckets."""

    images: int
    square_image: float
    bucket_image: float
    square_pixel: float
    bucket_pixel: float


def summarise(images: list[Image], buckets: list[Size] = SD_BUCKETS) -> dict[str, Kept]:
    """Per aspect class (in :data:`CLASSES` order) and ``"all"``: the kept means of both designs."""
    area = np.array([i.width * i.height for i in images], dtype=np.float64)
    sq = np.array([square_kept(i.width, i.height) for i in images])
    bu = np.array([bucket_kept(i.width, i.height, buckets) for i in images])
    cls = np.array([i.cls for i in images])
    out = {}
    for name in [*CLASSES, "all"]:
        m = np.ones(len(images), bool) if name == "all" else cls == name
        if not m.any():
            continue
        w = area[m] / area[m].sum()
        out[name] = Kept(int(m.sum()), sq[m].mean(), bu[m].mean(), float(sq[m] @ w), float(bu[m] @ w))
    return out


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    """A JPEG of ``width``×``height`` (blocky seeded colours, quality 90)."""
    import cv2

    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (max(1, height // 16), max(1, width // 16), 3), dtype=np.uint8)
    img = cv2.resize(blocks, (width, height), interpolation=cv2.INTER_NEAREST)
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    return buf.tobytes()


def decoded_kept(width: int, height: int, buckets: list[Size]) -> tuple[float, float]:
    """``(kept from decode_sample's bucket and resized_to, kept as planned)`` for a ``width``×``height`` JPEG;
    raises ``AssertionError`` if the decoded image is not the planned bucket's shape or the size is wrong."""
    out = decode_sample(f"{width}x{height}", {"jpg": jpeg(width, height), "txt": b"c"}, buckets)
    assert out.problem is None, out.problem
    assert (out.width, out.height) == (width, height), (out.width, out.height)
    expected = plan(width, height, buckets)
    assert out.bucket == expected.bucket and out.resized_to == expected.resized, (out.bucket, out.resized_to)
    assert out.image.shape == (out.bucket[1], out.bucket[0], 3), out.image.shape
    bw, bh = out.bucket
    rw, rh = out.resized_to
    return bw * bh / (rw * rh), kept_fraction(width, height, expected.bucket)


REAL_SHORT = 360
"""Shorter side of the JPEGs run through decode_sample (small: upscaled into the 512² buckets, fast)."""


def real_images(buckets: list[Size] = SD_BUCKETS) -> dict[str, tuple[int, int, float, float, float, float]]:
    """Per aspect class: (width, height, buckets kept via decode_sample, planned, square kept via
    decode_sample, ``min²/(w·h)``); fails if a decoded fraction differs from the plan."""
    rows = {}
    for cls in CLASSES:
        w, h = size_of(cls, REAL_SHORT)
        got, planned = decoded_kept(w, h, buckets)
        sq_got, sq_planned = decoded_kept(w, h, SQUARE)
        if abs(got - planned) > 1e-12 or abs(sq_got - sq_planned) > 1e-12:
            raise SystemExit(f"{cls} {w}x{h}: decode_sample kept {got}/{sq_got}, planned {planned}/{sq_planned}")
        rows[cls] = (w, h, got, planned, sq_got, square_kept(w, h))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1,000 images")
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    n = 1000 if args.quick else args.images
    images = fixture(n, args.seed)
    table = summarise(images)
    buckets = ", ".join(f"{w}x{h}" for w, h in SD_BUCKETS)
    print(f"{n} images (seed {args.seed}); buckets: {buckets}; square: 512x512 center crop")
    print(f"{'class':>6} {'images':>6} | per image: square  buckets | pixel-weighted: square  buckets | bucket")
    for name, k in table.items():
        chosen = "" if name == "all" else "{}x{}".format(*plan(*size_of(name, 700), SD_BUCKETS).bucket)
        print(
            f"{name:>6} {k.images:>6} |       {k.square_image:8.4f} {k.bucket_image:8.4f} |"
            f"            {k.square_pixel:8.4f} {k.bucket_pixel:8.4f} | {chosen}"
        )
    print("through decode_sample (JPEG → bucket; kept = bucket area / resized_to area, equal to the plan):")
    for cls, (w, h, got, _, sq_got, _) in real_images().items():
        print(f"{cls:>6} {w}x{h}: buckets {got:.4f}, square {sq_got:.4f}")
    k = table["all"]
    print(result_line(
        "data_kept", k.bucket_pixel / k.square_pixel, bucket_kept_pixel=k.bucket_pixel,
        square_kept_pixel=k.square_pixel, bucket_kept_image=k.bucket_image, square_kept_image=k.square_image,
        image_ratio=k.bucket_image / k.square_image, images=n, decode_checked=len(CLASSES), machine=machine(),
    ))  # fmt: skip


if __name__ == "__main__":
    main()
