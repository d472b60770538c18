"""DiffusionDB: zipped parts, each holding images and a JSON mapping file name → generation metadata.

Filter rows: ``archive, member, caption, seed, cfg, steps, sampler``; rows whose member is not in
its zip are dropped (``dropped_missing``), then repeated member names, first kept (``dropped_duplicate``).
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import polars as pl

from stages.common import InputError


def archive_rows(zip_path: Path, archive: str) -> tuple[list[dict[str, Any]], set[str]]:
    """The rows of one DiffusionDB zip's JSON mapping(s), and the names of the files it holds."""
    with zipfile.ZipFile(zip_path) as zf:
        names = set(zf.namelist())
        rows = []
        for json_name in sorted(n for n in names if n.endswith(".json")):
            mapping = json.loads(zf.read(json_name))
            for member in sorted(mapping):
                meta = mapping[member] or {}
                rows.append(
                    {
                        "archive": archive,
                        "member": member,
                        "caption": meta.get("p"),
                        "seed": meta.get("se"),
                        "cfg": meta.get("c"),
                        "steps": meta.get("st"),
                        "sampler": meta.get("sa"),
                    }
                )
    return rows, names


DIFFUSIONDB_SCHEMA = {
    "archive": pl.String,
    "member": pl.String,
    "caption": pl.String,
    "seed": pl.Int64,
    "cfg": pl.Float64,
    "steps": pl.Int64,
    "sampler": pl.String,
}


def filter_diffusiondb(in_dir: Path, out_file: Path) -> dict[str, int]:
    """Rows of every zip's mapping minus images missing from the zip and repeated member names."""
    zips = sorted(in_dir.rglob("*.zip"))
    if not zips:
        raise InputError(f"no zip archives under {in_dir} (run download_metadata first)")
    rows, present = [], []
    for zip_path in zips:
        zip_rows, names = archive_rows(zip_path, zip_path.relative_to(in_dir).as_posix())
        rows += zip_rows
        present += [row["member"] in names for row in zip_rows]
    df = pl.DataFrame(rows, schema=DIFFUSIONDB_SCHEMA).with_columns(_present=pl.Series(present, dtype=pl.Boolean))
    found = df.filter(pl.col("_present")).drop("_present")
    kept = found.filter(pl.col("member").is_first_distinct())
    kept.write_parquet(out_file)
    return {
        "files": len(zips),
        "rows_in": df.height,
        "dropped_missing": df.height - found.height,
        "dropped_duplicate": found.height - kept.height,
        "rows_out": kept.height,
    }
