"""The demo corpus: coloured shapes captioned like "a red circle on a white background", written in the
real sources' formats (LAION metadata parquet + images served over loopback, a DiffusionDB zip).

Images are drawn on the ``demo.canvases`` (width, height) in turn (:class:`CanvasCycle`): square and
non-square images alike, the shape sized from the canvas's shorter side; captions do not mention it.

Everything derives from ``demo.seed``; the bytes are identical run to run. The ``make_demo_data`` stage
writes it with :func:`build`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import uuid
import zipfile
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdforge.config import DemoData
from sdforge.demo.shapes import ShapeSpec, SpecDeck, render, shown_specs
from sdforge.io import atomic_write_bytes

log = logging.getLogger(__name__)

JPEG_QUALITY = 95
ZIP_DATE = (1980, 1, 1, 0, 0, 0)
LAION_FILE = "laion/part-00000.parquet"
ARCHIVE_PART = "part-000001"
CONCEPT_DIR = "concept"
WEBDUMP_DIR = "webdump"
PLACED_DIR = "placed"
WEBDUMP_TRUTH = "truth.json"
"""``{file-name caption: the caption it should have}`` beside the webdump images: what the recaptioned captions are
scored against (no pipeline stage reads it)."""
SMALL_SIZE = 16
SAMPLERS = ("k_lms", "k_euler", "k_euler_ancestral", "ddim", "plms")

LAION_SCHEMA = pa.schema(
    [
        ("URL", pa.string()),
        ("TEXT", pa.string()),
        ("WIDTH", pa.int64()),
        ("HEIGHT", pa.int64()),
        ("similarity", pa.float64()),
        ("punsafe", pa.float64()),
        ("pwatermark", pa.float64()),
        ("AESTHETIC_SCORE", pa.float64()),
        ("hash", pa.int64()),
    ]
)


def encode_image(rgb: np.ndarray, ext: str) -> bytes:
    """Encode an RGB uint8 image as ``.jpg`` (fixed quality) or ``.png`` bytes."""
    flags = [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY] if ext == ".jpg" else [cv2.IMWRITE_PNG_COMPRESSION, 6]
    ok, buf = cv2.imencode(ext, cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), flags)
    if not ok:
        raise RuntimeError(f"OpenCV could not encode a {ext} image")
    return buf.tobytes()


def deck(cfg: DemoData, rng: np.random.Generator) -> SpecDeck:
    """The shown (not held-out) combinations, drawn in balanced rounds from ``rng``."""
    return SpecDeck(shown_specs(list(cfg.colours), list(cfg.shapes), list(cfg.backgrounds), cfg.held_out), rng)


class CanvasCycle:
    """The corpus' canvases in turn: draw ``i`` of a source is on ``demo.canvases[i % len(demo.canvases)]``
    (``[(image_size, image_size)]`` when the list is empty), so ``n`` draws hold each canvas ``n // k`` or one
    more times. A cycle, not draws from ``rng``: the position/size random stream is the same whatever the
    canvases are (same draws as before canvases existed), and the counts are exact."""

    def __init__(self, cfg: DemoData):
        self.sizes, self.drawn = cfg.canvas_sizes, 0

    def next(self) -> tuple[int, int]:
        """The next ``(width, height)``."""
        size = self.sizes[self.drawn % len(self.sizes)]
        self.drawn += 1
        return size


def draw(
    cfg: DemoData, specs: SpecDeck, rng: np.random.Generator, canvas: tuple[int, int] | None = None
) -> tuple[ShapeSpec, np.ndarray]:
    """The deck's next spec and its RGB image on ``canvas`` (width, height; default: the first of
    ``demo.canvases``), position and size from ``rng``."""
    spec = specs.draw()
    colour, background = cfg.colours[spec.colour], cfg.backgrounds[spec.background]
    return spec, render(spec, canvas or cfg.canvas_sizes[0], colour, background, rng, cfg.half_size)


def stable_hash(*parts: object) -> int:
    """A deterministic non-negative int64 (stands in for LAION's ``hash`` column)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _draw(rng: np.random.Generator, low: float, high: float) -> float:
    return round(float(rng.uniform(low, high)), 4)


def good_row(
    cfg: DemoData, rng: np.random.Generator, url: str, caption: str, tag: str, size: tuple[int, int]
) -> dict[str, Any]:
    """A row that passes every quality rule (values drawn in the demo's 'good' ranges); ``size`` is its image's
    (width, height)."""
    return {
        "URL": url,
        "TEXT": caption,
        "WIDTH": int(size[0]),
        "HEIGHT": int(size[1]),
        "similarity": _draw(rng, 0.30, 0.40),
        "punsafe": _draw(rng, 0.0, 0.05),
        "pwatermark": _draw(rng, 0.0, 0.2),
        "AESTHETIC_SCORE": _draw(rng, 5.5, 8.0),
        "hash": stable_hash(cfg.seed, tag),
    }


def image_url(cfg: DemoData, name: str) -> str:
    """The loopback URL of demo image ``name`` (``fetch_images`` serves ``http/`` there)."""
    return f"http://127.0.0.1:{cfg.http_port}/images/{name}.jpg"


def laion_rows(cfg: DemoData, rng: np.random.Generator, http_root: Path) -> tuple[list[dict], dict[str, int]]:
    """All LAION rows in their final (shuffled) order, writing served images under ``http_root``."""
    served: list[dict] = []
    # served rows first: the images the model trains on are balanced (combinations and canvases)
    specs, canvases = deck(cfg, rng), CanvasCycle(cfg)
    for i in range(cfg.laion_rows):
        size = canvases.next()
        spec, img = draw(cfg, specs, rng, size)
        name = f"shape-{i:06d}"
        atomic_write_bytes(http_root / "images" / f"{name}.jpg", encode_image(img, ".jpg"))
        served.append(good_row(cfg, rng, image_url(cfg, name), spec.caption(), name, size))
    rows = list(served)
    for i in range(cfg.missing_rows):
        size = canvases.next()
        spec, _ = draw(cfg, specs, rng, size)
        rows.append(good_row(cfg, rng, image_url(cfg, f"missing-{i:06d}"), spec.caption(), f"missing-{i}", size))
    bad = {
        "low_aesthetic": (cfg.low_aesthetic_rows, lambda: {"AESTHETIC_SCORE": _draw(rng, 2.0, 4.9)}),
        "watermark": (cfg.watermark_rows, lambda: {"pwatermark": _draw(rng, 0.6, 1.0)}),
        "nsfw": (cfg.nsfw_rows, lambda: {"punsafe": _draw(rng, 0.6, 1.0)}),
        "small": (cfg.small_rows, lambda: {"WIDTH": SMALL_SIZE, "HEIGHT": SMALL_SIZE}),
    }
    for kind, (count, overrides) in bad.items():
        for i in range(count):
            size = canvases.next()
            spec, _ = draw(cfg, specs, rng, size)
            row = good_row(cfg, rng, image_url(cfg, f"{kind}-{i:06d}"), spec.caption(), f"{kind}-{i}", size)
            rows.append({**row, **overrides()})
    rows = [rows[i] for i in rng.permutation(len(rows))]
    n_url = insert_duplicates(cfg, rng, rows, served)
    counts = {
        "good_rows": cfg.laion_rows,
        "missing_rows": cfg.missing_rows,
        "low_aesthetic_rows": cfg.low_aesthetic_rows,
        "watermark_rows": cfg.watermark_rows,
        "nsfw_rows": cfg.nsfw_rows,
        "small_rows": cfg.small_rows,
        "duplicate_url_rows": n_url,
        "duplicate_hash_rows": cfg.duplicate_rows - n_url,
        "laion_rows_total": len(rows),
    }
    return rows, counts


def insert_duplicates(cfg: DemoData, rng: np.random.Generator, rows: list[dict], served: list[dict]) -> int:
    """Insert ``demo.duplicate_rows`` rows after their originals (in place); return how many repeat the URL.

    The first half repeat a served row's URL with an upper-case scheme/host and stray spaces (the
    filter normalises those); the rest repeat its ``hash`` under a new URL.
    """
    if cfg.duplicate_rows and not served:
        raise ValueError("demo.duplicate_rows needs demo.laion_rows > 0 (duplicates copy a good row)")
    n_url = (cfg.duplicate_rows + 1) // 2
    picks = rng.choice(len(served), size=cfg.duplicate_rows, replace=cfg.duplicate_rows > len(served))
    for i, pick in enumerate(picks):
        original = served[int(pick)]
        size = (original["WIDTH"], original["HEIGHT"])  # the same image as its original
        dup = good_row(cfg, rng, original["URL"], original["TEXT"], f"duplicate-{i}", size)
        if i < n_url:
            scheme, rest = original["URL"].split("://", 1)
            host, path = rest.split("/", 1)
            dup["URL"] = f" {scheme.upper()}://{host.upper()}/{path} "
        else:
            dup["URL"] = image_url(cfg, f"duplicate-{i:06d}")
            dup["hash"] = original["hash"]
        after = next(j for j, row in enumerate(rows) if row is original)
        rows.insert(int(rng.integers(after + 1, len(rows) + 1)), dup)
    return n_url


def write_laion(rows: list[dict], path: Path) -> None:
    """Write the LAION rows as one parquet file with LAION's column names and types."""
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=LAION_SCHEMA), buf)
    atomic_write_bytes(path, buf.getvalue())


def diffusiondb_zip(cfg: DemoData, rng: np.random.Generator) -> bytes:
    """A DiffusionDB-style zip: ``<uuid>.png`` images and ``part-NNNNNN.json`` (sorted, fixed dates)."""
    entries: dict[str, bytes] = {}
    mapping: dict[str, dict[str, Any]] = {}
    specs, canvases = deck(cfg, rng), CanvasCycle(cfg)
    for _ in range(cfg.archive_images):
        spec, img = draw(cfg, specs, rng, canvases.next())
        name = f"{uuid.UUID(bytes=rng.bytes(16), version=4)}.png"
        entries[name] = encode_image(img, ".png")
        mapping[name] = {
            "p": spec.caption(),
            "se": int(rng.integers(0, 2**32)),
            "c": float(rng.choice([5.0, 7.0, 7.5, 9.0, 12.0])),
            "st": int(rng.choice([25, 30, 50])),
            "sa": str(rng.choice(SAMPLERS)),
        }
    return diffusiondb_part_bytes(entries, ARCHIVE_PART, mapping)


def diffusiondb_part_bytes(images: dict[str, bytes], part: str, mapping: dict[str, dict[str, Any]]) -> bytes:
    """The bytes of DiffusionDB zip part ``part``: ``images`` and ``<part>.json`` (``mapping``: file name →
    ``{p, se, c, st, sa}``), members sorted with fixed dates, images stored, the JSON deflated."""
    entries = {**images, f"{part}.json": json.dumps(mapping, sort_keys=True).encode()}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name in sorted(entries):
            info = zipfile.ZipInfo(name, date_time=ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED if name.endswith(".json") else zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            zf.writestr(info, entries[name])
    return buf.getvalue()


def concept_images(cfg: DemoData, rng: np.random.Generator, folder: Path) -> int:
    """``demo.concept.images`` images of the concept colour (every shape and background in balanced rounds, the
    canvases in turn) as ``NNNNN.png`` + ``NNNNN.txt`` captions: a ``local`` source (``local.mode: txt``)."""
    concept = cfg.concept
    specs = SpecDeck(shown_specs([concept.colour], list(cfg.shapes), list(cfg.backgrounds), []), rng)
    canvases = CanvasCycle(cfg)
    for i in range(concept.images):
        spec = specs.draw()
        img = render(spec, canvases.next(), concept.rgb, cfg.backgrounds[spec.background], rng, cfg.half_size)
        atomic_write_bytes(folder / f"{i:05d}.png", encode_image(img, ".png"))
        atomic_write_bytes(folder / f"{i:05d}.txt", spec.caption().encode())
    return concept.images


def webdump_images(cfg: DemoData, rng: np.random.Generator, folder: Path) -> int:
    """``demo.webdump.images`` images of shown combinations (the canvases in turn) as ``NNNNN.png`` captioned only
    with a camera-style file name (``DSC_01000.JPG``), and :data:`WEBDUMP_TRUTH` with the captions they should have."""
    specs = SpecDeck(shown_specs(list(cfg.colours), list(cfg.shapes), list(cfg.backgrounds), cfg.held_out), rng)
    canvases, truth = CanvasCycle(cfg), {}
    for i in range(cfg.webdump.images):
        spec = specs.draw()
        img = render(spec, canvases.next(), cfg.colours[spec.colour], cfg.backgrounds[spec.background], rng,
                     cfg.half_size)  # fmt: skip
        atomic_write_bytes(folder / f"{i:05d}.png", encode_image(img, ".png"))
        name = f"DSC_{1000 + i:05d}.JPG"
        atomic_write_bytes(folder / f"{i:05d}.txt", name.encode())
        truth[name] = spec.caption()
    atomic_write_bytes(folder / WEBDUMP_TRUTH, json.dumps(truth, indent=1).encode())
    return cfg.webdump.images


def placed_images(cfg: DemoData, rng: np.random.Generator, folder: Path) -> int:
    """``demo.placed.images`` images of shown combinations, each shape small and anywhere on its canvas
    (``demo.placed.half_size``; the canvases in turn), as ``NNNNN.png`` + ``NNNNN.txt`` captions (a ``local``
    source)."""
    placed = cfg.placed
    specs = SpecDeck(shown_specs(list(cfg.colours), list(cfg.shapes), list(cfg.backgrounds), cfg.held_out), rng)
    canvases = CanvasCycle(cfg)
    for i in range(placed.images):
        spec = specs.draw()
        img = render(spec, canvases.next(), cfg.colours[spec.colour], cfg.backgrounds[spec.background], rng,
                     placed.half_size)  # fmt: skip
        atomic_write_bytes(folder / f"{i:05d}.png", encode_image(img, ".png"))
        atomic_write_bytes(folder / f"{i:05d}.txt", spec.caption().encode())
    return placed.images


def build(cfg: DemoData, out_dir: Path) -> dict[str, int]:
    """Write the enabled demo corpus into the (empty) ``out_dir``; return the row counts."""
    rows, counts = laion_rows(cfg, np.random.default_rng([cfg.seed, 0]), out_dir / "http")
    write_laion(rows, out_dir / LAION_FILE)
    archive = diffusiondb_zip(cfg, np.random.default_rng([cfg.seed, 1]))
    atomic_write_bytes(out_dir / "diffusiondb" / f"{ARCHIVE_PART}.zip", archive)
    counts = {**counts, "archive_images": cfg.archive_images}
    if cfg.concept is not None:
        counts["concept_images"] = concept_images(cfg, np.random.default_rng([cfg.seed, 2]), out_dir / CONCEPT_DIR)
    if cfg.webdump is not None:
        counts["webdump_images"] = webdump_images(cfg, np.random.default_rng([cfg.seed, 3]), out_dir / WEBDUMP_DIR)
    if cfg.placed is not None:
        counts["placed_images"] = placed_images(cfg, np.random.default_rng([cfg.seed, 4]), out_dir / PLACED_DIR)
    return counts
