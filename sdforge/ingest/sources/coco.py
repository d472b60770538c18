"""COCO 2017: images with a tall person, captioned from COCO captions.

Layout (cocodataset.org, unpacked): ``annotations/instances_train2017.json``,
``annotations/captions_train2017.json`` (globs ``coco.instances`` / ``coco.captions``) and the
images as loose files ``train2017/<file_name>`` (the folder named by the split in the instances
file's name) or ``<file_name>`` relative to the source folder. An image is kept when some non-crowd
``person`` box is at least ``coco.min_person_height`` × the image's ``height`` (from the JSON).
Row: ``archive`` null, ``member`` = the image's relative path, ``caption`` = the caption with the
lowest annotation id, ``meta`` = ``{image_id, captions (all, by id), person_height (best box height /
image height), persons (qualifying boxes), split}``.

Drops, in this order: ``bad_record`` (an image entry without an integer ``id``), ``duplicate``
(image id seen already), ``unsafe_member`` (absolute or ``..``
``file_name``), ``bad_size`` (width/height missing, not a number or ≤ 0), ``too_small``
(``filter.min_width``/``min_height`` on the JSON size), ``no_person``, ``no_caption``, ``missing``
(no image file). Extra metrics: ``invalid_boxes`` (person boxes with a null, negative or NaN
height, ignored), ``invalid_captions`` (caption annotations without a string caption, ignored).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from sdforge.bounds import json_docs
from sdforge.config import CocoOptions, FilterRules, InputLimits
from sdforge.ingest.sources.rows import DropCounter, inside, row, safe_member, write_rows
from sdforge.io import InputError

REASONS = ("bad_record", "duplicate", "unsafe_member", "bad_size", "too_small", "no_person", "no_caption", "missing")
_SPLIT = re.compile(r"^instances_(.+)\.json$")


def _load(path: Path, limits: InputLimits) -> dict[str, Any]:
    try:
        data = json_docs.load_file(path, limits)
    except json_docs.JsonLimitError as err:
        raise InputError(f"{path}: COCO annotation file over a limit: {err}") from None
    except (OSError, ValueError) as err:
        raise InputError(f"{path}: unreadable COCO annotation file ({type(err).__name__}: {err})") from None
    if not isinstance(data, dict):
        raise InputError(f"{path}: not a COCO annotation file (expected a JSON object)")
    return data


def _number(value: Any) -> float | None:
    """A finite number, or None (null, NaN, strings, booleans)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def captions_by_image(paths: list[Path], limits: InputLimits) -> tuple[dict[int, list[tuple[int, str]]], int]:
    """``{image_id: [(annotation id, caption), ...] sorted}`` and the count of invalid caption annotations."""
    captions: dict[int, list[tuple[int, str]]] = defaultdict(list)
    invalid = 0
    for path in paths:
        for ann in _load(path, limits).get("annotations") or []:
            if (
                isinstance(ann, dict)
                and _is_id(ann.get("image_id"))
                and isinstance(ann.get("caption"), str)
                and _is_id(ann.get("id"))
            ):
                captions[ann.get("image_id")].append((ann["id"], ann["caption"]))
            else:
                invalid += 1
    return {image_id: sorted(caps) for image_id, caps in captions.items()}, invalid


def person_heights(data: dict[str, Any]) -> tuple[dict[Any, list[float]], int]:
    """Non-crowd person box heights per image id, and the count of person boxes with an invalid height."""
    categories = data.get("categories") or []
    person_ids = {
        c.get("id") for c in categories if isinstance(c, dict) and c.get("name") == "person" and _is_id(c.get("id"))
    }
    heights: dict[Any, list[float]] = defaultdict(list)
    invalid = 0
    for ann in data.get("annotations") or []:
        if not isinstance(ann, dict) or not _is_id(ann.get("category_id")) or ann["category_id"] not in person_ids:
            continue
        if ann.get("iscrowd"):
            continue
        if not _is_id(ann.get("image_id")):
            invalid += 1
            continue
        bbox = ann.get("bbox")
        h = _number(bbox[3]) if isinstance(bbox, list) and len(bbox) == 4 else None
        if h is None or h <= 0:
            invalid += 1
        else:
            heights[ann.get("image_id")].append(h)
    return heights, invalid


def filter_coco(
    in_dir: Path,
    out_file: Path,
    options: CocoOptions,
    rules: FilterRules,
    limits: InputLimits = json_docs.DEFAULT_LIMITS,
    max_caption_chars: int | None = None,
) -> dict[str, int]:
    """One row per image with a person box ≥ ``min_person_height`` of its height and a caption. An annotation
    file over ``limits`` (``sources.<s>.inputs``) is an error naming it and the key."""
    instance_files, caption_files = _annotation_files(in_dir, options)
    captions, invalid_captions = captions_by_image(caption_files, limits)
    selector = _ImageSelector(in_dir, options, rules, captions)
    drops, rows, rows_in, invalid_boxes = DropCounter(REASONS), [], 0, 0
    for path in instance_files:
        data = _load(path, limits)
        split = _split_of(path)
        heights, invalid = person_heights(data)
        invalid_boxes += invalid
        for image in data.get("images") or []:
            rows_in += 1
            kept = selector.row_or_drop(image, split, heights)
            if isinstance(kept, str):
                drops.drop(kept)
            else:
                rows.append(kept)
    cut = write_rows(rows, out_file, max_caption_chars)
    return drops.metrics(
        captions_truncated=cut,
        files=len(instance_files) + len(caption_files),
        rows_in=rows_in,
        rows_out=len(rows),
        invalid_boxes=invalid_boxes,
        invalid_captions=invalid_captions,
    )


def _annotation_files(in_dir: Path, options: CocoOptions) -> tuple[list[Path], list[Path]]:
    """The instances and captions files (each sorted); an InputError when either kind is missing."""
    instance_files = sorted(in_dir.glob(options.instances))
    caption_files = sorted(in_dir.glob(options.captions))
    if not instance_files or not caption_files:
        raise InputError(
            f"{in_dir}: need COCO instances ({options.instances!r}: {len(instance_files)} found) and captions "
            f"({options.captions!r}: {len(caption_files)} found) annotation files (run download_metadata first)"
        )
    return instance_files, caption_files


def _split_of(instances_file: Path) -> str | None:
    """``train2017`` for ``instances_train2017.json``; None for a name of another shape."""
    match = _SPLIT.match(instances_file.name)
    return match[1] if match else None


class _ImageSelector:
    """Decides each image entry of the instances files: its row, or the first drop reason (in REASONS order)."""

    def __init__(
        self, in_dir: Path, options: CocoOptions, rules: FilterRules, captions: dict[int, list[tuple[int, str]]]
    ):
        self.in_dir, self.options, self.rules, self.captions = in_dir, options, rules, captions
        self.seen: set[int] = set()

    def row_or_drop(self, image: Any, split: str | None, heights: dict[Any, list[float]]) -> dict[str, Any] | str:
        """The image's row, or the reason it is dropped; ``heights`` are its file's person box heights."""
        image = image if isinstance(image, dict) else {}
        image_id, file_name = image.get("id"), safe_member(image.get("file_name"))
        width, height = _number(image.get("width")), _number(image.get("height"))
        problem = self._entry_problem(image_id, file_name, width, height)
        if problem:
            return problem
        # h / height, not h >= min × height: 0.55 × 50 is 27.500000000000004 in floating point
        tall = [h for h in heights.get(image_id, []) if h / height >= self.options.min_person_height]
        if not tall:
            return "no_person"
        captions = self.captions.get(image_id)
        if not captions:
            return "no_caption"
        member = image_file(self.in_dir, split, file_name)
        if member is None:
            return "missing"
        meta = {
            "image_id": image_id,
            "captions": [c for _, c in captions],
            "person_height": round(max(tall) / height, 4),
            "persons": len(tall),
            "split": split,
        }
        return row(None, member, captions[0][1], meta)

    def _entry_problem(
        self, image_id: Any, file_name: str | None, width: float | None, height: float | None
    ) -> str | None:
        """The drop reason of the image entry itself (id, name, size), or None; marks its id as seen."""
        if not _is_id(image_id):
            return "bad_record"
        if image_id in self.seen:
            return "duplicate"
        self.seen.add(image_id)
        if file_name is None:
            return "unsafe_member"
        if width is None or height is None or width <= 0 or height <= 0:
            return "bad_size"
        rules = self.rules
        if (rules.min_width is not None and width < rules.min_width) or (
            rules.min_height is not None and height < rules.min_height
        ):
            return "too_small"
        return None


def image_file(in_dir: Path, split: str | None, file_name: str) -> str | None:
    """The image's path relative to ``in_dir``: ``<split>/<file_name>`` or ``<file_name>``, if a regular
    file inside ``in_dir``."""
    for rel in ([f"{split}/{file_name}"] if split else []) + [file_name]:
        path = in_dir / rel
        if path.is_file() and inside(path, in_dir):
            return rel
    return None
