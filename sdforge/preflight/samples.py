"""Small samples of a configured source, written in that kind's real on-disk format.

``sdforge preflight`` runs the full configuration end to end on a few items per source: each source's
``repo`` is pointed at a fresh local folder that :func:`write_sample_source` fills, so the real
``download_metadata`` → ``filter_metadata`` → ``fetch_images`` stages run on it unchanged. The format
writers (:func:`write_journeydb`, :func:`write_vggface2`, :func:`write_coco`, :func:`write_files` and
their helpers) are also what the source tests build their fixtures with (``tests/fixtures/sources.py``
re-exports them), so the tests and the preflight share one copy of each format.

Decisions a caller must know:

* Every item passes the source's configured ``filter`` (LAION thresholds with a margin, unique URL and
  hash; COCO person boxes above ``coco.min_person_height``; VGGFace2 sizes) and every file written
  matches ``allow_patterns`` as ``download_metadata`` matches them (``fnmatch`` on the path relative to
  ``repo``, where ``*`` also crosses ``/``); a layout the patterns miss is a :class:`ValueError`, not a
  silently empty sample.
* Images are square, ``max(fetch.image_size, filter.min_width, filter.min_height)`` a side: at least
  the output size, and never under a configured minimum (VGGFace2's 512 holds even when a test shrinks
  ``image_size``). LAION's ``WIDTH``/``HEIGHT`` columns state that side; the re-shard/fetch step
  resizes to ``fetch.image_size``.
* ``laion``: images are served, not stored in ``repo``: ``http_dir/<name>/<i>.jpg`` at
  ``{url_base}/<name>/<i>.jpg`` (the caller serves ``http_dir`` on loopback and must set
  ``fetch.allow_networks`` so the SSRF guard lets the fetch through). The metadata is one parquet,
  ``part-00000.parquet``, with the configured ``columns`` names.
* ``diffusiondb`` stores PNGs (its 2M release's format), the other kinds JPEGs (quality 95).
  ``journeydb`` puts everything in archive ``000.tgz``; ``vggface2`` puts two images per identity and
  ``meta/identity_meta.csv``; ``coco`` writes the 2017 file names; ``local`` writes ``sample-NNNNNN.jpg``
  at the top of ``repo`` with a ``.txt`` (or, for ``local.mode: json``, a tag ``.json`` whose score
  passes ``min_score`` and whose tags avoid ``exclude_tags``).
* Contents are seeded by ``seed`` and the source name: smooth two-colour gradients, a few anti-aliased
  shapes (a person-like figure for COCO and VGGFace2), a slight blur and mild noise, with a caption
  naming what is drawn. The same arguments write the same bytes (zip dates fixed, gzip/tar mtimes 0).
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import math
import tarfile
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdforge.config import Source
from sdforge.control.edges import canny_edges
from sdforge.demo.corpus import diffusiondb_part_bytes, encode_image, stable_hash
from sdforge.ingest.metadata import matching_files

log = logging.getLogger(__name__)

KINDS = ("laion", "diffusiondb", "journeydb", "vggface2", "coco", "local")
"""The source kinds :func:`write_sample_source` can write."""
DIFFUSIONDB_PART = "part-000001"
JOURNEYDB_ARCHIVE = "000"
LAION_FILE = "part-00000.parquet"
SAMPLERS = ("k_lms", "k_euler", "k_euler_ancestral", "ddim", "plms")
PALETTE = {
    "red": (200, 40, 40),
    "orange": (235, 140, 30),
    "yellow": (240, 210, 60),
    "green": (50, 150, 70),
    "teal": (30, 140, 140),
    "blue": (40, 80, 200),
    "purple": (120, 60, 170),
    "pink": (230, 130, 170),
    "brown": (120, 80, 40),
    "white": (240, 240, 235),
    "grey": (128, 128, 128),
    "black": (25, 25, 30),
}
SHAPES = ("circle", "square", "triangle", "ellipse")
STYLES = (
    "a photo of",
    "a painting of",
    "a watercolour of",
    "an illustration of",
    "a close-up shot of",
    "a minimalist poster of",
)


# ---------------------------------------------------------------- the on-disk formats (shared with the tests)


def add_member(
    tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, link: str = ""
) -> None:
    """Add ``name`` to ``tar``: a regular file holding ``data``, or another member ``kind`` pointing at ``link``."""
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size, info.mtime = kind, link, len(data) if kind == tarfile.REGTYPE else 0, 0
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def journeydb_record(img_path: str, prompt: Any, caption: Any = "a description") -> dict[str, Any]:
    """One annotation line, shaped like ``train_anno_realease_repath.jsonl``."""
    return {
        "img_path": img_path,
        "url": "https://cdn.midjourney.com/x/grid_0.png",
        "prompt": prompt,
        "Task1": {"Style": ["photo"], "Content": ["cat"]},
        "Task2": {"Caption": caption},
        "Task3": {"Questions": ["?"], "Options": [["a"]], "Answers": ["a"]},
    }


def write_journeydb(root: Path, archives: dict[str, dict[str, bytes]], lines: list[dict | str]) -> None:
    """JourneyDB under ``root``: ``data/train/imgs/<stem>.tgz`` and the annotation ``.jsonl.tgz``.

    ``archives``: stem → {file name: bytes} (stored as ``<stem>/<file name>``); ``lines``: records
    (dicts) or raw text lines of the annotation JSONL.
    """
    imgs = root / "data" / "train" / "imgs"
    imgs.mkdir(parents=True, exist_ok=True)
    for stem, files in archives.items():
        write_tgz(imgs / f"{stem}.tgz", {f"{stem}/{name}": data for name, data in files.items()})
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()
    write_tgz(
        root / "data" / "train" / "train_anno_realease_repath.jsonl.tgz", {"train_anno_realease_repath.jsonl": text}
    )


def write_tgz(path: Path, members: dict[str, bytes]) -> None:
    """A gzipped tar of ``members`` (name → bytes), byte-identical run to run (gzip and tar mtimes 0)."""
    with path.open("wb") as fh, gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0) as gz:
        with tarfile.open(fileobj=gz, mode="w") as tar:
            for name, data in members.items():
                add_member(tar, name, data)


def write_vggface2(root: Path, images: dict[str, bytes], identities: list[tuple[str, str, str]]) -> None:
    """VGGFace2 under ``root``: ``images`` (path under ``train/`` → bytes) and ``meta/identity_meta.csv``
    from ``identities`` (``(Class_ID, Name, Gender)`` rows, a space after each comma as in the release)."""
    for rel, data in images.items():
        (root / "train" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "train" / rel).write_bytes(data)
    meta = root / "meta" / "identity_meta.csv"
    meta.parent.mkdir(parents=True, exist_ok=True)
    lines = ["Class_ID, Name, Sample_Num, Flag, Gender"]
    lines += [f'{cid}, "{name}", 1, 1, {gender}' for cid, name, gender in identities]
    meta.write_text("\n".join(lines) + "\n")


def write_coco(
    root: Path,
    images: list[dict[str, Any]],
    boxes: list[tuple[int, list[float], int]],
    captions: list[tuple[int, int, Any]],
    files: dict[str, bytes],
) -> None:
    """COCO 2017 under ``root``: ``annotations/{instances,captions}_train2017.json`` and ``files``.

    ``images``: COCO image entries; ``boxes``: ``(image_id, bbox, iscrowd)`` person boxes;
    ``captions``: ``(annotation id, image_id, caption)``; ``files``: relative path → bytes. A tall dog
    box on the first image checks that only ``person`` boxes qualify an image.
    """
    categories = [
        {"supercategory": "person", "id": 1, "name": "person"},
        {"supercategory": "animal", "id": 18, "name": "dog"},
    ]
    annotations = [
        {"id": 1000 + i, "image_id": image_id, "category_id": 1, "bbox": bbox, "iscrowd": crowd, "area": 1.0}
        for i, (image_id, bbox, crowd) in enumerate(boxes)
    ]
    annotations.append(
        {"id": 999, "image_id": images[0]["id"], "category_id": 18, "bbox": [0, 0, 9, 9999], "iscrowd": 0}
    )
    info = {"description": "COCO 2017 Dataset", "version": "1.0"}
    instances = {"info": info, "images": images, "annotations": annotations, "categories": categories}
    caption_anns = [{"id": cid, "image_id": image_id, "caption": text} for cid, image_id, text in captions]
    (root / "annotations").mkdir(parents=True, exist_ok=True)
    (root / "annotations" / "instances_train2017.json").write_text(json.dumps(instances))
    (root / "annotations" / "captions_train2017.json").write_text(
        json.dumps({"info": info, "images": images, "annotations": caption_anns})
    )
    write_files(root, files)


def coco_image(image_id: int, w: int, h: int, file_name: str | None = None) -> dict[str, Any]:
    """A COCO ``images`` entry (file name ``<id:012d>.jpg`` unless given)."""
    return {"id": image_id, "width": w, "height": h, "file_name": file_name or f"{image_id:012d}.jpg", "license": 1}


def write_files(root: Path, files: dict[str, bytes | str]) -> None:
    """Write each relative path → bytes (or UTF-8 text) under ``root``, creating folders."""
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode() if isinstance(data, str) else data)


def write_diffusiondb(root: Path, part: str, images: dict[str, bytes], mapping: dict[str, dict[str, Any]]) -> None:
    """DiffusionDB part ``images/<part>.zip`` (:func:`sdforge.demo.corpus.diffusiondb_part_bytes`)."""
    write_files(root, {f"images/{part}.zip": diffusiondb_part_bytes(images, part, mapping)})


# ---------------------------------------------------------------- sample images and captions


class Drawn(NamedTuple):
    """One sample: an RGB uint8 image, its caption and the tags the caption is built from."""

    rgb: np.ndarray
    caption: str
    tags: list[str]


def _gradient(rng: np.random.Generator, size: int, start: tuple[int, ...], end: tuple[int, ...]) -> np.ndarray:
    """A smooth two-colour gradient in a random direction, with a gentle wave along it."""
    angle = rng.uniform(0, 2 * math.pi)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    t = (xx - 0.5) * math.cos(angle) + (yy - 0.5) * math.sin(angle)
    t += 0.06 * np.sin(2 * math.pi * (rng.uniform(0.5, 2.0) * (xx + yy) + rng.uniform(0, 1)))
    t = ((t - t.min()) / max(float(t.max() - t.min()), 1e-6))[..., None]
    img = np.asarray(start, np.float32) * (1 - t) + np.asarray(end, np.float32) * t
    return np.ascontiguousarray(img.astype(np.uint8))


def _draw_shape(img: np.ndarray, rng: np.random.Generator, shape: str, colour: tuple[int, ...]) -> None:
    """Draw one anti-aliased filled ``shape`` at a random place, size and angle."""
    size = img.shape[0]
    cx, cy = (int(v) for v in rng.integers(int(size * 0.15), int(size * 0.85) + 1, 2))
    r = max(int(size * rng.uniform(0.06, 0.2)), 2)
    angle = float(rng.uniform(0, 180))
    if shape == "circle":
        cv2.circle(img, (cx, cy), r, colour, -1, cv2.LINE_AA)
    elif shape == "ellipse":
        cv2.ellipse(img, (cx, cy), (r, max(r // 2, 1)), angle, 0, 360, colour, -1, cv2.LINE_AA)
    else:
        corners = 4 if shape == "square" else 3
        phases = np.radians(angle) + 2 * np.pi * np.arange(corners) / corners
        pts = np.stack([cx + r * np.cos(phases), cy + r * np.sin(phases)], axis=1).astype(np.int32)
        cv2.fillPoly(img, [pts], colour, cv2.LINE_AA)


def write_control_image(path: Path, side: int, thresholds: dict[str, int], seed: int = 0) -> Path:
    """The Canny map (``thresholds``: ``conditions.canny``) of one image drawn as the samples are — a gradient with
    a circle, a square and a triangle — ``side`` px square, white edges on black: a conditioning image for ``sdforge
    generate --control-image`` (the preflight's generate step on a ControlNet phase)."""
    rng = np.random.default_rng(seed)
    img = _gradient(rng, side, (30, 30, 60), (220, 210, 190))
    for shape in SHAPES[:3]:
        _draw_shape(img, rng, shape, tuple(int(c) for c in rng.integers(0, 256, 3)))
    edges = canny_edges(img, **thresholds)
    cv2.imwrite(str(path), np.repeat((edges * 255).astype(np.uint8)[..., None], 3, axis=2))
    return path


def _draw_figure(img: np.ndarray, box: tuple[float, float, float, float], clothes: tuple[int, ...]) -> None:
    """A person-like figure filling ``box`` = ``(x, y, w, h)`` in pixels: a head over a body."""
    x, y, w, h = box
    head = max(int(min(w, h) * 0.22), 1)
    cx = int(x + w / 2)
    cv2.ellipse(img, (cx, int(y + h * 0.62)), (max(int(w * 0.42), 1), max(int(h * 0.38), 1)), 0, 0, 360, clothes, -1)
    cv2.circle(img, (cx, int(y + head + 1)), head, (205, 165, 135), -1, cv2.LINE_AA)


def _article(phrase: str) -> str:
    """``phrase`` with "a" or "an" in front."""
    return f"{'an' if phrase[:1] in 'aeiou' else 'a'} {phrase}"


def draw_sample(rng: np.random.Generator, size: int, figure: tuple[float, ...] | None = None) -> Drawn:
    """A ``size``×``size`` image of 1-3 shapes on a gradient (plus a figure in ``figure`` = ``(x, y, w, h)``),
    slightly blurred with mild noise, and a caption naming what is drawn."""
    names = list(PALETTE)
    first, second = (names[int(i)] for i in rng.choice(len(names), 2, replace=False))
    img = _gradient(rng, size, PALETTE[first], PALETTE[second])
    tags = []
    for _ in range(int(rng.integers(1, 4))):
        colour, shape = names[int(rng.integers(len(names)))], SHAPES[int(rng.integers(len(SHAPES)))]
        _draw_shape(img, rng, shape, PALETTE[colour])
        tags.append(f"{colour} {shape}")
    if figure is not None:
        clothes = names[int(rng.integers(len(names)))]
        _draw_figure(img, tuple(figure), PALETTE[clothes])
        tags.insert(0, f"person in {clothes}")
    img = cv2.GaussianBlur(img, (0, 0), sigmaX=max(size / 256, 0.5))
    img = np.clip(img + rng.normal(0, 4, img.shape), 0, 255).astype(np.uint8)
    things = [_article(tag) for tag in tags]
    listed = things[0] if len(things) == 1 else ", ".join(things[:-1]) + " and " + things[-1]
    style = STYLES[int(rng.integers(len(STYLES)))]
    caption = f"{style} {listed} in front of a soft {first} to {second} gradient"
    return Drawn(img, caption, [*tags, f"{first} and {second} gradient", style.split(" of")[0].split(" ", 1)[1]])


# ---------------------------------------------------------------- one writer per kind


@dataclass(frozen=True)
class _Job:
    """What a kind's writer needs: the source, where to write, how many items, the image side, the rng."""

    name: str
    source: Source
    repo: Path
    http_dir: Path
    url_base: str
    n: int
    side: int
    rng: np.random.Generator

    def jpeg(self, figure: tuple[float, ...] | None = None) -> tuple[bytes, Drawn]:
        """A fresh sample's JPEG bytes and the sample."""
        drawn = draw_sample(self.rng, self.side, figure)
        return encode_image(drawn.rgb, ".jpg"), drawn


def _above(low: float | None, rng: np.random.Generator, default: tuple[float, float], margin: float) -> float:
    """A value that passes a ``≥ low`` rule (``low`` None: drawn from ``default``)."""
    if low is None:
        return round(float(rng.uniform(*default)), 4)
    return round(max(low, 0.0) + float(rng.uniform(margin, 4 * margin)), 4)


def _below(high: float | None, rng: np.random.Generator, what: str) -> float:
    """A probability that passes a ``< high`` rule (``high`` None: under 0.1)."""
    if high is not None and high <= 0:
        raise ValueError(f"filter.max_{what} {high}: no value passes it (the rule is 0 ≤ x < max)")
    return round(float(rng.uniform(0.0, 0.5)) * (0.2 if high is None else high), 4)


def _laion(job: _Job) -> None:
    """Served JPEGs under ``http_dir/<name>/`` and one parquet of rows passing every configured rule."""
    rules, cols = job.source.filter, job.source.columns
    rows = []
    for i in range(job.n):
        data, drawn = job.jpeg()
        (job.http_dir / job.name).mkdir(parents=True, exist_ok=True)
        (job.http_dir / job.name / f"{i}.jpg").write_bytes(data)
        rows.append(
            {
                cols.url: f"{job.url_base.rstrip('/')}/{job.name}/{i}.jpg",
                cols.caption: drawn.caption,
                cols.width: job.side,
                cols.height: job.side,
                cols.similarity: _above(rules.min_similarity, job.rng, (0.28, 0.38), 0.005),
                cols.punsafe: _below(rules.max_punsafe, job.rng, "punsafe"),
                cols.pwatermark: _below(rules.max_pwatermark, job.rng, "pwatermark"),
                cols.aesthetic: _above(rules.min_aesthetic, job.rng, (5.5, 8.0), 0.05),
                cols.hash: stable_hash("preflight", job.name, i),
            }
        )
    text, ints = {cols.url, cols.caption}, {cols.width, cols.height, cols.hash}
    schema = pa.schema([(c, pa.string() if c in text else pa.int64() if c in ints else pa.float64()) for c in rows[0]])
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), buf)
    write_files(job.repo, {LAION_FILE: buf.getvalue()})


def _diffusiondb(job: _Job) -> None:
    """One zipped part of ``<uuid>.png`` images and its prompt JSON."""
    images, mapping = {}, {}
    for _ in range(job.n):
        drawn = draw_sample(job.rng, job.side)
        name = f"{uuid.UUID(bytes=job.rng.bytes(16), version=4)}.png"
        images[name] = encode_image(drawn.rgb, ".png")
        mapping[name] = {
            "p": drawn.caption,
            "se": int(job.rng.integers(0, 2**32)),
            "c": float(job.rng.choice([5.0, 7.0, 7.5, 9.0, 12.0])),
            "st": int(job.rng.choice([25, 30, 50])),
            "sa": str(job.rng.choice(SAMPLERS)),
        }
    write_diffusiondb(job.repo, DIFFUSIONDB_PART, images, mapping)


def _journeydb(job: _Job) -> None:
    """One image archive and the annotation JSONL, each record with both a prompt and a Task2 caption."""
    files, lines = {}, []
    for i in range(job.n):
        data, drawn = job.jpeg()
        digest = f"{stable_hash('preflight', job.name, i):016x}{stable_hash('jdb', i):016x}"
        files[f"{digest}.jpg"] = data
        prompt, description = f"{drawn.caption}, highly detailed", f"The image shows {drawn.caption}."
        lines.append(journeydb_record(f"./{JOURNEYDB_ARCHIVE}/{digest}.jpg", prompt, description))
    write_journeydb(job.repo, {JOURNEYDB_ARCHIVE: files}, lines)


def _vggface2(job: _Job) -> None:
    """Two face-like images per identity under ``train/`` and the identity CSV (genders alternate)."""
    images, identities = {}, {}
    for i in range(job.n):
        identity = f"n{i // 2 + 1:06d}"
        s = job.side
        images[f"{identity}/{i % 2 + 1:04d}_01.jpg"], _ = job.jpeg((s * 0.2, s * 0.08, s * 0.6, s * 0.92))
        gender = "m" if (i // 2) % 2 == 0 else "f"
        identities[identity] = (identity, f"Preflight_Person_{i // 2 + 1}", gender)
    write_vggface2(job.repo, images, list(identities.values()))


def _coco(job: _Job) -> None:
    """COCO images, each with a person box taller than ``coco.min_person_height`` and two captions."""
    s, low = job.side, job.source.coco.min_person_height
    images, boxes, captions, files = [], [], [], {}
    for i in range(job.n):
        image_id = i + 1
        h = min(float(s), math.ceil(s * (low + (1 - low) * float(job.rng.uniform(0.1, 0.9))) * 100) / 100)
        w = s * float(job.rng.uniform(0.2, 0.4))
        x, y = float(job.rng.uniform(0, s - w)), float(job.rng.uniform(0, s - h))
        data, drawn = job.jpeg((x, y, w, h))
        images.append(coco_image(image_id, s, s))
        files[f"train2017/{images[-1]['file_name']}"] = data
        boxes.append((image_id, [round(x, 2), round(y, 2), round(w, 2), h], 0))
        second = f"{_article(drawn.tags[0])} next to {_article(drawn.tags[1])}"
        captions += [(2 * image_id, image_id, drawn.caption), (2 * image_id + 1, image_id, second)]
    write_coco(job.repo, images, boxes, captions, files)


def _local(job: _Job) -> None:
    """``sample-NNNNNN.jpg`` with a caption ``.txt``, or (json mode) a tag ``.json`` that passes the rules."""
    opts = job.source.local
    files: dict[str, bytes | str] = {}
    for i in range(job.n):
        data, drawn = job.jpeg()
        stem = f"sample-{i:06d}"
        files[f"{stem}.jpg"] = data
        if opts.mode == "txt":
            files[f"{stem}.txt"] = drawn.caption + "\n"
            continue
        excluded = set(opts.exclude_tags)
        tags = [t for t in drawn.tags if t not in excluded and opts.replace_tags.get(t, t) not in excluded]
        score = (opts.min_score or 0.0) + 1.0 + sum(abs(v) for v in opts.tag_score_bonus.values())
        files[f"{stem}.json"] = json.dumps({"tags": tags, "score": score})
    write_files(job.repo, files)


WRITERS = {
    "laion": _laion,
    "diffusiondb": _diffusiondb,
    "journeydb": _journeydb,
    "vggface2": _vggface2,
    "coco": _coco,
    "local": _local,
}


# ---------------------------------------------------------------- entry point


def _check_patterns(name: str, source: Source, repo: Path) -> int:
    """The number of files under ``repo``; a ValueError when ``allow_patterns`` would not copy one of them."""
    written = sorted(p for p in repo.rglob("*") if p.is_file())
    matched = set(matching_files(repo, source.allow_patterns)[0])
    missed = [p.relative_to(repo).as_posix() for p in written if p not in matched]
    if missed:
        raise ValueError(
            f"sources.{name}: allow_patterns {source.allow_patterns} miss the {source.kind} sample files "
            f"{missed[:5]}{' ...' if len(missed) > 5 else ''}; download_metadata would not copy them"
        )
    return len(written)


def write_sample_source(name: str, source: dict, repo: Path, http_dir: Path, url_base: str, n: int, seed: int) -> dict:
    """Write ``n`` items of source ``name`` (its raw ``sources:`` params) into the fresh folder ``repo``.

    The items are in the kind's on-disk format, match ``allow_patterns`` and pass ``filter``, so the
    real stages run on ``repo`` unchanged (with ``repo`` set as the source's ``repo``). ``laion``
    images go to ``http_dir/<name>/<i>.jpg``, named in the parquet as ``{url_base}/<name>/<i>.jpg``.
    Returns ``{"kind", "items", "files" (under repo), "image_size" (the side written)}``; an unknown
    kind or a pattern that misses the layout is a ValueError naming the source.
    """
    kind = source.get("kind")
    if kind not in WRITERS:
        raise ValueError(f"sources.{name}: kind {kind!r} has no sample writer (it can write: {', '.join(KINDS)})")
    if n < 1:
        raise ValueError(f"sources.{name}: a sample needs at least one item; got n={n}")
    typed = Source.model_validate({**source, "repo": str(repo)})
    rules = typed.filter
    side = max(typed.fetch.image_size, rules.min_width or 0, rules.min_height or 0)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    repo = Path(repo)
    repo.mkdir(parents=True, exist_ok=True)
    WRITERS[kind](_Job(name, typed, repo, Path(http_dir), url_base, n, side, rng))
    files = _check_patterns(name, typed, repo)
    log.info("sources.%s: wrote %d %s sample item(s), %d file(s), %d px, into %s", name, n, kind, files, side, repo)
    return {"kind": kind, "items": n, "files": files, "image_size": side}


COCO_SIDE = 640
"""The width of the COCO sample's images (COCO's are mostly 640×480)."""


def write_coco_val(root: Path, n: int, side: int, seed: int) -> Path:
    """COCO-2014 val's layout under ``root`` for the COCO protocol (:mod:`sdforge.eval.coco`): ``n`` drawn images
    ``val2014/COCO_val2014_<id>.jpg`` (``side`` wide, 3:4, as COCO's are not square) and
    ``annotations/captions_val2014.json`` with two captions each; returns the captions file."""
    rng = np.random.default_rng([seed, zlib.crc32(b"coco_val2014")])
    images, annotations = [], []
    (root / "val2014").mkdir(parents=True, exist_ok=True)
    for image_id in range(1, n + 1):
        drawn = draw_sample(rng, side)
        name = f"COCO_val2014_{image_id:012d}.jpg"
        rgb = cv2.resize(drawn.rgb, (side, side * 3 // 4), interpolation=cv2.INTER_AREA)
        (root / "val2014" / name).write_bytes(encode_image(rgb, ".jpg"))
        images.append({"id": image_id, "file_name": name, "width": side, "height": side * 3 // 4})
        annotations += [{"id": 10 * image_id + k, "image_id": image_id, "caption": caption}
                        for k, caption in enumerate((drawn.caption, " and ".join(drawn.tags[:2])))]  # fmt: skip
    path = root / "annotations" / "captions_val2014.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"info": {"description": "COCO 2014 Dataset"}, "images": images,
                                "annotations": annotations}))  # fmt: skip
    return path
