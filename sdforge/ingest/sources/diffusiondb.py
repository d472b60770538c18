"""DiffusionDB: zipped parts, each holding images and a JSON mapping file name → generation metadata.

``poloclub/diffusiondb`` ``images/part-NNNNNN.zip``: ``<uuid>.png`` (2M) or ``.webp`` (large)
images and ``part-NNNNNN.json`` = ``{file name: {"p": prompt, "se": seed, "c": cfg, "st": steps,
"sa": sampler}}``. Row: ``archive`` = the zip (relative path), ``member`` = the file name,
``caption`` = ``p``, ``meta`` = ``{seed, cfg, steps, sampler}``.

Drops, in this order (each row counted once): ``unsafe_member`` (absolute or ``..`` name),
``no_caption`` (null/missing/non-string prompt), ``missing`` (not in its zip), ``duplicate``
(name already kept from an earlier zip, or stored twice in its zip). The image size is unknown
here: ``filter.min_width``/``min_height`` are applied when re-sharding.
"""

from __future__ import annotations

import json
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

from sdforge.config import FilterRules
from sdforge.ingest.sources.rows import DropCounter, row, safe_member, write_rows
from sdforge.io import InputError

REASONS = ("unsafe_member", "no_caption", "missing", "duplicate")
META_KEYS = {"se": "seed", "c": "cfg", "st": "steps", "sa": "sampler"}


def read_mappings(zip_path: Path) -> tuple[list[tuple[str, Any]], Counter]:
    """``(file name, entry)`` of every JSON mapping in the zip (sorted), and the zip's name counts."""
    try:
        with zipfile.ZipFile(zip_path) as zf:
            names = Counter(zf.namelist())
            entries = []
            for json_name in sorted(n for n in names if n.endswith(".json")):
                mapping = json.loads(zf.read(json_name))
                if not isinstance(mapping, dict):
                    raise InputError(f"{zip_path}: {json_name} is not a JSON object (file name → metadata)")
                entries += sorted(mapping.items())
    except (zipfile.BadZipFile, OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{zip_path}: unreadable DiffusionDB part ({type(err).__name__}: {err})") from None
    return entries, names


def filter_diffusiondb(in_dir: Path, out_file: Path, rules: FilterRules) -> dict[str, int]:
    """Rows of every zip's mapping minus unsafe names, null prompts, images missing from the zip and repeats."""
    zips = sorted(in_dir.rglob("*.zip"))
    if not zips:
        raise InputError(f"no zip archives under {in_dir} (run download_metadata first)")
    drops, rows, kept, rows_in = DropCounter(REASONS), [], set(), 0
    for zip_path in zips:
        archive = zip_path.relative_to(in_dir).as_posix()
        entries, names = read_mappings(zip_path)
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
    write_rows(rows, out_file, min_width=rules.min_width, min_height=rules.min_height)
    return drops.metrics(files=len(zips), rows_in=rows_in, rows_out=len(rows))
