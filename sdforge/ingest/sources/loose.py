"""Loose image files (VGGFace2, local folders): scan, refuse escaping symlinks, dedup by stem, size rules."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

from sdforge.bounds.paths import resolves_to_file
from sdforge.config import FilterRules
from sdforge.ingest.sources.images import ImageRejected, header_size
from sdforge.ingest.sources.rows import IMAGE_EXTENSIONS, DropCounter, inside, stem_key

log = logging.getLogger(__name__)

REASONS = ("unsafe_member", "duplicate", "unreadable", "too_small")
"""Drops of :func:`images`, in the order they are tested."""


def scan(root: Path) -> list[tuple[str, Path]]:
    """``(relative posix path, path)`` of every image file under ``root``, sorted; symlinked
    directories are not descended into (logged)."""
    found, skipped_dirs = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames:
            if (Path(dirpath) / name).is_symlink():
                skipped_dirs.append(Path(dirpath, name).relative_to(root).as_posix())
        for name in filenames:
            if Path(name).suffix.lower() in IMAGE_EXTENSIONS:
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    if skipped_dirs:
        log.warning("%s: not following %d symlinked directories: %s", root, len(skipped_dirs), skipped_dirs[:5])
    return sorted(found)


def images(
    root: Path, rules: FilterRules, drops: DropCounter, files: list[tuple[str, Path]], max_pixels: int | None = None
) -> Iterator[tuple[str, Path, tuple[int, int] | None]]:
    """The usable images among ``files``: ``(member, path, (w, h) or None)``; the rest counted in ``drops``.

    A symlink must resolve to a regular file inside ``root``; of several files with the same path
    minus suffix (``a.jpg``, ``a.png``) the first in sorted order is kept. When the filter has a
    minimum size, each header is read (PIL, no pixel decoding) and the rule applied here; a header over
    ``max_pixels`` (``fetch.max_image_pixels``: fetch would refuse it) counts as ``unreadable`` before
    Pillow decodes a PNG's pixels looking for EXIF.
    """
    seen: set[str] = set()
    read_headers = rules.min_width is not None or rules.min_height is not None
    for member, path in files:
        if path.is_symlink() and not (inside(path, root) and resolves_to_file(path)):
            drops.drop("unsafe_member")
            continue
        if stem_key(member) in seen:
            drops.drop("duplicate")
            continue
        seen.add(stem_key(member))
        size = None
        if read_headers:
            try:
                size = header_size(path, max_pixels)
            except ImageRejected:
                drops.drop("unreadable")
                continue
            w, h = size
            if (rules.min_width is not None and w < rules.min_width) or (
                rules.min_height is not None and h < rules.min_height
            ):
                drops.drop("too_small")
                continue
        yield member, path, size
