"""Local folder: images with a same-name caption ``.txt`` (``local.mode: txt``) or tag ``.json`` (``json``).

Any folder tree of images (``.jpg .jpeg .png .webp .bmp .gif .tif .tiff``). ``txt``: ``a.jpg`` +
``a.txt`` (UTF-8; surrounding whitespace stripped) is the caption. ``json``: ``a.json`` =
``{"tags": [str, ...], "score": number}``; tags are stripped, then ``replace_tags`` maps them, a
sample with any ``exclude_tags`` is dropped, ``tag_score_bonus`` is added to the score per tag
present, ``min_score`` is tested on the result (a null/NaN score fails it), ``remove_tags`` go,
repeats go, and with probability ``shuffle_tags`` the order is shuffled (``random.Random`` seeded
by ``local.seed`` and the path: the same on every run). Caption = tags joined with ``", "``.
Row: ``archive`` null, ``member`` = the image's relative path, ``meta`` = ``{tags, score,
adjusted_score}`` (json) or ``{}`` (txt).

Drops, in this order: those of :data:`sdforge.ingest.sources.loose.REASONS`, then ``no_caption`` (no
``.txt`` / ``.json``), ``bad_caption`` (not UTF-8, not JSON, tags not a list of strings, score not
a number), ``json_too_deep`` / ``json_too_large`` / ``json_too_many_entries`` (a ``.json`` over
``sources.<s>.inputs``), ``excluded_tag``, ``no_score`` / ``low_score`` (only with ``min_score``).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from sdforge.bounds import json_docs
from sdforge.bounds.captions import read_caption_file
from sdforge.config import FilterRules, InputLimits, LocalOptions
from sdforge.ingest.sources import loose
from sdforge.ingest.sources.rows import TRUNCATED_COLUMN, DropCounter, inside, row, write_rows
from sdforge.io import InputError

REASONS = (*loose.REASONS, "no_caption", "bad_caption", *json_docs.REASONS, "excluded_tag", "no_score", "low_score")


class Dropped(Exception):
    """A sample dropped for ``reason``."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def read_sidecar(image: Path, suffix: str, max_bytes: int | None = None) -> str:
    """The UTF-8 text of ``image``'s side file with ``suffix``, or :class:`Dropped`; over ``max_bytes``: dropped
    as ``json_too_large`` before it is read."""
    return _read_sidecar(image, suffix, max_bytes)[0]


def read_caption_sidecar(image: Path, max_chars: int | None) -> tuple[str, bool]:
    """``image``'s ``.txt`` caption, stripped, read only as far as ``max_chars`` characters, and whether it was cut;
    or :class:`Dropped`."""
    text, cut = _read_sidecar(image, ".txt", None, max_chars)
    return text.strip(), cut


def _read_sidecar(
    image: Path, suffix: str, max_bytes: int | None, max_chars: int | None = None
) -> tuple[str, bool]:
    path = image.with_suffix(suffix)
    if not path.is_file():
        raise Dropped("no_caption")
    if path.is_symlink() and not inside(path, image.parent):
        raise Dropped("unsafe_member")
    try:
        if max_bytes is not None and path.stat().st_size > max_bytes:
            raise Dropped(json_docs.TOO_LARGE)
        return read_caption_file(path, max_chars)
    except (UnicodeDecodeError, OSError):
        raise Dropped("bad_caption") from None


def parse_tags(text: str, limits: InputLimits = json_docs.DEFAULT_LIMITS) -> tuple[list[str], float | None]:
    """``(tags, score)`` of a tag JSON; the score is None when null, absent or NaN."""
    try:
        data = json_docs.loads(text, limits)
    except json_docs.JsonLimitError as err:
        raise Dropped(err.reason) from None
    except ValueError:
        raise Dropped("bad_caption") from None
    tags = data.get("tags") if isinstance(data, dict) else None
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise Dropped("bad_caption")
    score = data.get("score")
    if score is not None and (isinstance(score, bool) or not isinstance(score, int | float)):
        raise Dropped("bad_caption")
    if score is not None and not math.isfinite(score):
        score = None
    return tags, score


def process_tags(
    member: str, tags: list[str], score: float | None, options: LocalOptions
) -> tuple[list[str], float | None]:
    """The caption's tags and the adjusted score, or :class:`Dropped`."""
    tags = [options.replace_tags.get(t, t) for t in (t.strip() for t in tags) if t]
    tags = [t for t in tags if t]
    if any(t in options.exclude_tags for t in tags):
        raise Dropped("excluded_tag")
    adjusted = None if score is None else score + sum(options.tag_score_bonus.get(t, 0.0) for t in set(tags))
    if options.min_score is not None:
        if adjusted is None:
            raise Dropped("no_score")
        if adjusted < options.min_score:
            raise Dropped("low_score")
    kept = list(dict.fromkeys(t for t in tags if t not in options.remove_tags))
    rng = random.Random(f"{options.seed}:{member}")
    if options.shuffle_tags and rng.random() < options.shuffle_tags:
        rng.shuffle(kept)
    return kept, adjusted


def caption_of(
    member: str,
    path: Path,
    options: LocalOptions,
    limits: InputLimits = json_docs.DEFAULT_LIMITS,
    max_caption_chars: int | None = None,
) -> tuple[str, dict[str, Any], bool]:
    """``(caption, meta, cut)`` for one image, or :class:`Dropped`; a ``.txt`` caption is read only as far as
    ``max_caption_chars`` characters (``cut``: it went on)."""
    if options.mode == "txt":
        caption, cut = read_caption_sidecar(path, max_caption_chars)
        return caption, {}, cut
    tags, score = parse_tags(read_sidecar(path, ".json", limits.json_max_bytes), limits)
    kept, adjusted = process_tags(member, tags, score, options)
    return ", ".join(kept), {"tags": kept, "score": score, "adjusted_score": adjusted}, False


def filter_local(
    in_dir: Path,
    out_file: Path,
    options: LocalOptions,
    rules: FilterRules,
    max_pixels: int | None = None,
    limits: InputLimits = json_docs.DEFAULT_LIMITS,
    max_caption_chars: int | None = None,
) -> dict[str, int]:
    """One row per image with a usable caption file."""
    files = loose.scan(in_dir)
    if not files:
        raise InputError(f"no images under {in_dir} (run download_metadata first)")
    drops, rows = DropCounter(REASONS), []
    for member, path, _ in loose.images(in_dir, rules, drops, files, max_pixels):
        try:
            caption, meta, cut = caption_of(member, path, options, limits, max_caption_chars)
        except Dropped as dropped:
            drops.drop(dropped.reason)
            continue
        rows.append(row(None, member, caption, meta) | {TRUNCATED_COLUMN: cut})
    cut = write_rows(rows, out_file, max_caption_chars)
    return drops.metrics(files=len(files), rows_in=len(files), rows_out=len(rows), captions_truncated=cut)
