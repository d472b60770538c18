"""The input side of ``encode_latents``: stream WebDataset tars, decode + resize images, tokenize captions.

Python's :mod:`tarfile` costs ~65 µs per member (≈ 200 µs per jpg/txt/json sample), as much as the
demo VAE's share of a CPU core per image; :func:`iter_tar_members` reads the ustar headers itself with
:mod:`sdforge.ingest.ustar` (GNU long names and pax paths included) in a few µs. Damage (bad checksum, short
read) raises :class:`TarDamaged`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import cv2
import numpy as np

from sdforge.bounds import json_docs
from sdforge.bounds.captions import UTF8_MAX_BYTES_PER_CHAR, cut_caption, decode_caption
from sdforge.bounds.images import MAX_BYTES_PER_PIXEL, ImageRejected, check_header
from sdforge.ingest.buckets import CropPlan, Size, plan
from sdforge.ingest.ustar import (
    BLOCK,
    END_BLOCK,
    GNU_LONG_NAME,
    PAX_HEADER,
    REGULAR_TYPES,
    TarDamaged,
    long_name,
    parse_header,
    pax_records,
)
from sdforge.io import InputError
from sdforge.latents import s3_inputs

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
_IMREAD_RGB = getattr(cv2, "IMREAD_COLOR_RGB", cv2.IMREAD_COLOR)
"""Decode straight to RGB (OpenCV ≥ 4.10), else BGR + cvtColor."""


@dataclass(frozen=True)
class TarInput:
    """One input tar: output shard number, name, where to read it (local path or s3:// URL), size."""

    shard: int
    name: str
    path: str
    size: int
    etag: str | None = None
    """S3 only: the object's ETag (lets a rerun check a finished shard without downloading its input)."""


def list_inputs(shard_dir: str | Path) -> list[TarInput]:
    """The input tars, sorted; shard number = the tar's numeric stem (else its position)."""
    if s3_inputs.is_s3(str(shard_dir)):
        found = s3_inputs.list_tars(str(shard_dir))
    else:
        found = [(p.name, str(p), p.stat().st_size, None) for p in Path(shard_dir).glob("*.tar")]
    if not found:
        raise InputError(f"{shard_dir}: no .tar shards found (did fetch_images run?)")
    found.sort()
    stems = [name.removesuffix(".tar") for name, *_ in found]
    numeric = all(s.isdigit() for s in stems) and len({int(s) for s in stems}) == len(stems)
    return [
        TarInput(int(stem) if numeric else i, name, path, size, etag)
        for i, (stem, (name, path, size, etag)) in enumerate(zip(stems, found, strict=True))
    ]



# ------------------------------------------------------------------------------------- tar stream


class HashingReader:
    """A read-only buffered file wrapper that feeds every byte it reads into ``digest``.

    The file is read (and hashed) in ``chunk``-sized blocks; ``read(n)`` serves slices of them, so
    the many small reads of tar headers cost a slice, not a file read plus a hash update each.
    """

    def __init__(self, fh, digest, chunk: int = 1 << 20):
        self.fh, self.digest, self.chunk = fh, digest, chunk
        self.buf, self.pos = b"", 0

    def read(self, n: int) -> bytes:
        end = self.pos + n
        if end <= len(self.buf):
            out = self.buf[self.pos : end]
            self.pos = end
            return out
        parts, have = [self.buf[self.pos :]], len(self.buf) - self.pos
        while have < n:
            block = self.fh.read(max(self.chunk, n - have))
            if not block:
                break
            self.digest.update(block)
            parts.append(block)
            have += len(block)
        self.buf, self.pos = b"".join(parts), min(n, have)
        return self.buf[:n]

    def drain(self) -> None:
        """Read (and hash) the rest of the file."""
        self.buf, self.pos = b"", 0
        while block := self.fh.read(self.chunk):
            self.digest.update(block)


SKIP_CHUNK = 1 << 20
MAX_HEADER_MEMBER = 1 << 20
"""A GNU long-name or pax header member over this is damage (real ones hold a path and a few records)."""


def _read_member(fh, size: int, keep: int | None) -> bytes:
    """A member's ``size`` bytes (+ padding) read from ``fh``; with ``keep`` below ``size``, only the first ``keep``
    bytes are kept and the rest is read through in 1 MiB chunks (hashed, never held)."""
    padded = size + (-size % BLOCK)
    if keep is None or size <= keep:
        data = fh.read(padded)
        if len(data) < padded:
            raise TarDamaged("the archive ends inside a member")
        return data[:size] if padded != size else data
    data, left = fh.read(keep), padded - keep
    if len(data) < keep:
        raise TarDamaged("the archive ends inside a member")
    while left:
        got = len(fh.read(min(left, SKIP_CHUNK)))
        if not got:
            raise TarDamaged("the archive ends inside a member")
        left -= got
    return data


def iter_tar_members(fh, keep: Callable[[str], int | None] | None = None) -> Iterator[tuple[str, bytes]]:
    """``(name, data)`` of every regular file in a tar stream, in order; raise :class:`TarDamaged`. ``keep(name)``:
    how many bytes of a member to keep (None: all); a longer member's rest is read through, not held — a 100 MB
    caption costs its first bytes only."""
    next_name: str | None = None
    while True:
        header = fh.read(BLOCK)
        if not header or header == END_BLOCK:
            return  # end of archive
        if len(header) < BLOCK:
            raise TarDamaged("the archive ends inside a header")
        size, kind, name = parse_header(header)
        if kind in (GNU_LONG_NAME, PAX_HEADER) and size > MAX_HEADER_MEMBER:
            raise TarDamaged(f"a {size:,}-byte long-name/pax header (at most {MAX_HEADER_MEMBER:,} are read)")
        member = name.decode("utf-8", errors="replace") if next_name is None else next_name
        data = _read_member(fh, size, keep(member) if keep and kind in REGULAR_TYPES else None)
        if kind == GNU_LONG_NAME:
            next_name = long_name(data).decode("utf-8", errors="replace")
            continue
        if kind == PAX_HEADER:
            try:
                path = pax_records(data).get(b"path")
            except ValueError:
                raise TarDamaged("unreadable pax header") from None
            if path:  # else a GNU long name before it still holds
                next_name = path.decode("utf-8", errors="replace")
            continue
        if kind in REGULAR_TYPES:
            yield member, data
        next_name = None


def split_key(name: str) -> tuple[str, str]:
    """WebDataset's ``dir/KEY.ext.more`` → ``("dir/KEY", "ext.more")`` (first dot of the base name)."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    return (name, "") if dot < 0 else (name[:dot], name[dot + 1 :])


JSON_MEMBER_BYTES = 1 << 20
"""A sample's ``.json`` (its original size) is read this far; a longer one fails to parse: the size is unknown."""


def member_bounds(max_caption_chars: int | None, max_pixels: int | None = None) -> Callable[[str], int | None] | None:
    """The ``keep`` of :func:`iter_tar_members`: a ``.txt`` member is read only as far as ``max_caption_chars``
    characters can use, an image only to ``max_pixels × MAX_BYTES_PER_PIXEL`` (past it: ``too_large``), a
    ``.json`` to :data:`JSON_MEMBER_BYTES` — one byte more each, so that the cut is seen."""
    bounds = {"json": JSON_MEMBER_BYTES + 1}
    if max_caption_chars is not None:
        bounds["txt"] = max_caption_chars * UTF8_MAX_BYTES_PER_CHAR + 1
    if max_pixels is not None:
        bounds |= dict.fromkeys(IMAGE_EXTS, max_pixels * MAX_BYTES_PER_PIXEL + 1)
    return lambda name: bounds.get(split_key(name)[1])


def iter_tar_groups(
    fh, counts: Counter, max_caption_chars: int | None = None, max_pixels: int | None = None
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Stream ``(key, {ext: bytes})`` from a WebDataset tar; a repeated key is skipped, damage ends it.

    Both are counted (``skipped_duplicate_key``, ``tar_errors``); the sample being read when the
    damage shows is dropped. Members are read only as far as :func:`member_bounds` says.
    """
    key, files, seen = None, {}, set()
    try:
        for name, data in iter_tar_members(fh, member_bounds(max_caption_chars, max_pixels)):
            member_key, ext = split_key(name)
            if member_key != key:
                if key is not None and key not in seen:
                    seen.add(key)
                    yield key, files
                elif key is not None:
                    counts["skipped_duplicate_key"] += 1
                key, files = member_key, {}
            files[ext] = data
    except TarDamaged as err:
        counts["tar_errors"] += 1
        log.warning("input tar is damaged (%s): sample %s and those after it are lost", err, key)
        return
    if key is not None and key not in seen:
        yield key, files
    elif key is not None:
        counts["skipped_duplicate_key"] += 1


# ---------------------------------------------------------------------------------- images, text


@dataclass
class Decoded:
    """One sample after decoding; ``image`` is None when it was skipped (``problem`` says why).

    ``image`` has its bucket's shape; ``crop`` is the box (left, top, right, bottom) cut from the image
    resized (aspect kept) to ``resized_to`` — SDXL's crop conditioning — and ``width``/``height`` the
    size found in the tar."""

    key: str
    caption: str
    image: np.ndarray | None
    width: int | None = None
    height: int | None = None
    original_width: int | None = None
    original_height: int | None = None
    resized: bool = False
    problem: str | None = None
    bucket: Size | None = None
    resized_to: Size | None = None
    crop: tuple[int, int, int, int] | None = None
    synthetic: str | None = None
    """The sample's synthetic caption (caption_images), None when it has none."""
    caption_cut: bool = False
    """The caption (or its synthetic one) was cut to ``max_caption_chars`` before tokenization."""


def cover_crop(img: np.ndarray, crop_plan: CropPlan) -> np.ndarray:
    """Resize ``img`` (aspect kept) to ``crop_plan.resized`` (INTER_AREA down, INTER_CUBIC up), cut ``crop_plan.box``.

    With a square bucket this is the shorter side scaled to the bucket's and the centre square cut
    (the encoder's behaviour before buckets, byte for byte)."""
    h, w = img.shape[:2]
    if (w, h) != crop_plan.resized:
        down = crop_plan.resized[0] * crop_plan.resized[1] < w * h
        img = cv2.resize(img, crop_plan.resized, interpolation=cv2.INTER_AREA if down else cv2.INTER_CUBIC)
    left, top, right, bottom = crop_plan.box
    return img[top:bottom, left:right]


def decode_sample(
    key: str,
    files: dict[str, bytes],
    buckets: Sequence[Size],
    wrong_size: str = "resize",
    max_pixels: int | None = None,
    max_caption_chars: int | None = None,
) -> Decoded:
    """Decode one WebDataset sample to RGB at its nearest bucket (:func:`sdforge.ingest.buckets.plan`);
    bad samples come back with a ``problem``. ``max_pixels`` (``fetch.max_image_pixels``): an image whose
    header declares more pixels, or whose resize to cover its bucket would make more (a very thin one), is
    ``too_large`` — checked before the pixels are decoded or resized (the fetch stage never writes one; a shard
    from elsewhere may). ``max_caption_chars`` (``sources.<s>.fetch.max_caption_chars``): the caption is cut to
    it before it is decoded whole, tokenized or stored (:mod:`sdforge.bounds.captions`)."""
    caption, cut = decode_caption(files.get("txt", b""), max_caption_chars)
    meta = _sizes(files.get("json"))
    out = Decoded(key, caption, None, original_width=meta[0], original_height=meta[1], caption_cut=cut)
    data = next((files[e] for e in IMAGE_EXTS if e in files), None)
    if data is None:
        out.problem = "no_image"
        return out
    if max_pixels is not None:
        try:
            if len(data) > max_pixels * MAX_BYTES_PER_PIXEL:  # cut short by the tar reader (member_bounds)
                raise ImageRejected("too_large", f"{len(data)} bytes")
            check_header(data, max_pixels)
        except ImageRejected:
            out.problem = "too_large"
            return out
    try:
        img = cv2.imdecode(np.frombuffer(data, np.uint8), _IMREAD_RGB)
    except cv2.error:
        img = None
    if img is None or img.size == 0:
        out.problem = "corrupt"
        return out
    out.height, out.width = img.shape[:2]
    crop_plan = plan(out.width, out.height, list(buckets))
    out.bucket, out.resized_to, out.crop = crop_plan.bucket, crop_plan.resized, crop_plan.box
    if max_pixels is not None and crop_plan.resized[0] * crop_plan.resized[1] > max_pixels:
        out.problem = "too_large"
        return out
    if (out.width, out.height) != crop_plan.bucket:
        if wrong_size == "skip":
            out.problem = "wrong_size"
            return out
        img, out.resized = cover_crop(img, crop_plan), True
    out.image = img if _IMREAD_RGB != cv2.IMREAD_COLOR else cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    return out


def decode_chunk(
    chunk: list[tuple[str, dict[str, bytes]]],
    buckets: Sequence[Size],
    wrong_size: str,
    synthetic: dict[str, str] | None = None,
    max_pixels: int | None = None,
    max_caption_chars: int | None = None,
) -> list[Decoded]:
    """:func:`decode_sample` over several samples (one pool job: less per-sample overhead); each gets its
    synthetic caption from ``synthetic`` (by key, cut to ``max_caption_chars`` too) when there is one."""
    out = [decode_sample(key, files, buckets, wrong_size, max_pixels, max_caption_chars) for key, files in chunk]
    if synthetic:
        for sample in out:
            text = synthetic.get(sample.key)
            if text is not None:
                sample.synthetic, cut = cut_caption(text, max_caption_chars)
                sample.caption_cut |= cut
    return out


def _sizes(data: bytes | None) -> tuple[int | None, int | None]:
    """The original size a sample's ``.json`` records (None where unreadable, over the default JSON limits of
    :mod:`sdforge.bounds.json_docs`, or absent: the sample is kept, its size unknown)."""
    try:
        meta = json_docs.loads(data, json_docs.DEFAULT_LIMITS) if data else {}
    except ValueError:
        return None, None
    if not isinstance(meta, dict):
        return None, None
    return tuple(v if isinstance(v := meta.get(k), int) else None for k in ("original_width", "original_height"))


class Tokens:
    """Caption → (token ids padded/truncated to the model length, truncated?), one tokenizer call per
    new caption; repeated captions (templates, the demo) come from a bounded cache."""

    def __init__(self, tokenizer, cache_size: int = 100_000):
        self.tokenizer, self.cache_size = tokenizer, cache_size
        self.max_len = tokenizer.model_max_length
        self.cache: dict[str, tuple[list[int], bool]] = {}

    def __call__(self, captions: list[str]) -> tuple[torch.Tensor, list[bool]]:
        """Token ids ``[B, max_len]`` int32 (as ``tokenizer(..., padding="max_length", truncation=True)``)
        and, per caption, whether it was truncated."""
        new = list(dict.fromkeys(c for c in captions if c not in self.cache))
        if new:
            if len(self.cache) + len(new) > self.cache_size:
                self.cache.clear()
            tok = self.tokenizer
            # one token over the model's length is enough to tell a cut caption, and the tokenizer warns
            # ("sequence length is longer ... indexing errors") when asked for more than its length unbounded
            encoded = tok(new, truncation=True, max_length=self.max_len + 1).input_ids
            for caption, ids in zip(new, encoded, strict=True):
                cut = len(ids) > self.max_len
                ids = [*ids[: self.max_len - 1], tok.eos_token_id] if cut else ids
                row = np.array(ids + [tok.pad_token_id] * (self.max_len - len(ids)), dtype=np.int32)
                self.cache[caption] = (row, cut)
        rows = [self.cache[c] for c in captions]
        import torch  # here: reading and cropping tars (condition_images) needs no torch (~1.5 s per process)

        return torch.from_numpy(np.stack([r[0] for r in rows])), [r[1] for r in rows]
