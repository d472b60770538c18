"""DiffusionDB: zipped parts, each holding images and a JSON mapping file name → generation metadata.

``poloclub/diffusiondb`` ``images/part-NNNNNN.zip``: ``<uuid>.png`` (2M) or ``.webp`` (large)
images and ``part-NNNNNN.json`` = ``{file name: {"p": prompt, "se": seed, "c": cfg, "st": steps,
"sa": sampler}}``. Row: ``archive`` = the zip (relative path), ``member`` = the file name,
``caption`` = ``p``, ``meta`` = ``{seed, cfg, steps, sampler}``.

Drops, in this order (each row counted once): ``bad_metadata`` (every image of a part whose JSON mapping is
not a JSON object, not JSON, or over ``sources.<s>.inputs``: the part is skipped with a warning naming it and
the rest of the source kept), ``unsafe_member`` (absolute or ``..`` name),
``no_caption`` (null/missing/non-string prompt), ``missing`` (not in its zip), ``duplicate``
(name already kept from an earlier zip, or stored twice in its zip). The image size is unknown
here: ``filter.min_width``/``min_height`` are applied when re-sharding.
"""

from __future__ import annotations

import logging
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

from sdforge.bounds import json_docs
from sdforge.bounds.archives import inflate_limit
from sdforge.config import FilterRules, InputLimits
from sdforge.ingest.sources.rows import DropCounter, row, safe_member, write_rows
from sdforge.io import InputError

REASONS = ("bad_metadata", "unsafe_member", "no_caption", "missing", "duplicate")
log = logging.getLogger(__name__)

META_KEYS = {"se": "seed", "c": "cfg", "st": "steps", "sa": "sampler"}


def read_mappings(zip_path: Path, limits: InputLimits) -> tuple[list[tuple[str, Any]], Counter, str | None]:
    """``(file name, entry)`` of every JSON mapping in the zip (sorted), the zip's name counts, and why its
    mappings were unusable (a JSON member over ``limits`` or not a JSON object: none are returned) or None."""
    try:
        with zipfile.ZipFile(zip_path) as zf:
            names = Counter(zf.namelist())
            entries = []
            for info in sorted((i for i in zf.infolist() if i.filename.endswith(".json")), key=lambda i: i.filename):
                problem = _mapping_problem(zf, info, limits, entries)
                if problem is not None:
                    log.warning("%s: %s: %s; the part's images are dropped as bad_metadata", zip_path, info.filename,
                                problem)  # fmt: skip
                    return [], names, problem
    except (zipfile.BadZipFile, OSError) as err:
        raise InputError(f"{zip_path}: unreadable DiffusionDB part ({type(err).__name__}: {err})") from None
    return entries, names, None


def _mapping_problem(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limits: InputLimits, entries: list) -> str | None:
    """Append the mapping of JSON member ``info`` to ``entries``; or why it cannot be read (nothing appended).
    Its declared size and ratio are checked before it is read: ``zipfile`` stops inflating a member at that
    size (a member that inflates further fails its CRC: a bad part, not a bomb)."""
    if info.file_size > limits.json_max_bytes:
        return str(json_docs.JsonLimitError(json_docs.TOO_LARGE, f"{info.file_size:,}-byte JSON member", limits))
    if info.file_size > inflate_limit(info.compress_size, limits):
        return (f"inflates {info.compress_size:,} bytes to {info.file_size:,} (sources.<source>.inputs."
                f"archive_max_ratio {limits.archive_max_ratio}): a decompression bomb")  # fmt: skip
    try:
        mapping = json_docs.loads(zf.read(info), limits)
    except (ValueError, zipfile.BadZipFile) as err:  # not JSON, not UTF-8, over a limit, or a bad CRC/size
        return f"{type(err).__name__}: {err}"
    if not isinstance(mapping, dict):
        return "not a JSON object (file name → metadata)"
    entries += sorted(mapping.items())
    return None


def filter_diffusiondb(
    in_dir: Path,
    out_file: Path,
    rules: FilterRules,
    limits: InputLimits = json_docs.DEFAULT_LIMITS,
    max_caption_chars: int | None = None,
) -> dict[str, int]:
    """Rows of every zip's mapping minus unsafe names, null prompts, images missing from the zip and repeats;
    a part whose mapping is unusable costs its images (``bad_metadata``), not the source."""
    zips = sorted(in_dir.rglob("*.zip"))
    if not zips:
        raise InputError(f"no zip archives under {in_dir} (run download_metadata first)")
    drops, rows, kept, rows_in = DropCounter(REASONS), [], set(), 0
    for zip_path in zips:
        archive = zip_path.relative_to(in_dir).as_posix()
        entries, names, problem = read_mappings(zip_path, limits)
        if problem is not None:
            images = sum(n for name, n in names.items() if not name.endswith(".json") and not name.endswith("/"))
            rows_in += images
            drops.drop("bad_metadata", images)
        for name, entry in entries:
            rows_in += 1
            entry = entry if isinstance(entry, dict) else {}
            member, caption = safe_member(name), entry.get("p")
            if member is None or member != name:
                drops.drop("unsafe_member")
            elif not isinstance(caption, str):
                drops.drop("no_caption")
            elif member not in names:
                drops.drop("missing")
            elif member in kept or names[member] > 1:
                drops.drop("duplicate")
            else:
                kept.add(member)
                rows.append(row(archive, member, caption, {v: entry.get(k) for k, v in META_KEYS.items()}))
    cut = write_rows(rows, out_file, max_caption_chars, min_width=rules.min_width, min_height=rules.min_height)
    return drops.metrics(files=len(zips), rows_in=rows_in, rows_out=len(rows), captions_truncated=cut)
