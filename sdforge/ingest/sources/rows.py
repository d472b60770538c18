"""The filtered-row schema every local source writes, and the helpers the adapters share.

A row names one image on disk: ``archive`` (path of its zip/tar relative to the source's metadata
folder; null for a loose file), ``member`` (path inside the archive, or the loose file's relative
path), ``caption`` and ``meta`` (a JSON object of source-specific fields, copied into each sample's
``.json``). Rows are sorted by ``(archive, member)``, loose files first.

Size rules that an adapter cannot apply at filter time (the image is inside an archive) travel to
the re-shard step in the parquet's key-value metadata (:data:`RESHARD_CHECKS_KEY`), so
``fetch_images`` needs no filter settings of its own and DVC re-runs it when they change.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from sdforge.bounds.captions import cut_caption
from sdforge.bounds.paths import resolves_inside
from sdforge.io import naming_write_faults

ROW_COLUMNS = ("archive", "member", "caption", "meta")
TRUNCATED_COLUMN = "caption_truncated"
"""True where the caption was cut to ``sources.<s>.fetch.max_caption_chars`` (:mod:`sdforge.bounds.captions`)."""
ROW_SCHEMA = pa.schema([*((name, pa.string()) for name in ROW_COLUMNS), (TRUNCATED_COLUMN, pa.bool_())])
RESHARD_CHECKS_KEY = b"sdforge.reshard_checks"
"""Parquet metadata key: JSON ``{"min_width": int|null, "min_height": int|null}`` applied when re-sharding."""

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
"""Suffixes (lower-cased) taken as images when scanning loose files."""


def safe_member(name: object) -> str | None:
    """``name`` as a clean relative posix path (leading ``./`` dropped), or None when it is not a
    string, empty, absolute, or has a ``..`` component, a backslash or a NUL byte."""
    if not isinstance(name, str) or "\\" in name or "\0" in name:
        return None
    while name.startswith("./"):
        name = name[2:]
    path = PurePosixPath(name)
    if not name or path.is_absolute() or any(part in ("..", "") for part in name.split("/")):
        return None
    return path.as_posix()


def finite_or_none(value: Any) -> Any:
    """``value`` with NaN/inf floats (at any depth) replaced by None, so that it is valid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): finite_or_none(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite_or_none(v) for v in value]
    return value


def meta_json(meta: dict[str, Any]) -> str:
    """The ``meta`` column: compact, key-sorted JSON; NaN/inf become null."""
    return json.dumps(finite_or_none(meta), sort_keys=True, ensure_ascii=False, allow_nan=False)


def row(archive: str | None, member: str, caption: str, meta: dict[str, Any]) -> dict[str, str | None]:
    """One filtered row."""
    return {"archive": archive, "member": member, "caption": caption, "meta": meta_json(meta)}


class DropCounter:
    """Counts dropped rows by reason; every declared reason is reported, zero or not."""

    def __init__(self, reasons: Iterable[str]):
        self.counts = dict.fromkeys(reasons, 0)

    def drop(self, reason: str, n: int = 1) -> None:
        if reason not in self.counts:
            raise KeyError(f"undeclared drop reason {reason!r} (declared: {list(self.counts)})")
        self.counts[reason] += n

    def metrics(self, files: int, rows_in: int, rows_out: int, **extra: int) -> dict[str, int]:
        """``files, rows_in, dropped_<reason>..., rows_out`` (+ ``extra``); checks that the counts add up."""
        dropped = sum(self.counts.values())
        if rows_in != dropped + rows_out:
            raise AssertionError(f"rows_in {rows_in} != dropped {dropped} + rows_out {rows_out}: {self.counts}")
        out = {"files": files, "rows_in": rows_in}
        out |= {f"dropped_{reason}": n for reason, n in self.counts.items()}
        return out | {"rows_out": rows_out} | extra


def write_rows(
    rows: list[dict[str, Any]],
    out_file: Path,
    caption_max_chars: int | None = None,
    min_width: int | None = None,
    min_height: int | None = None,
) -> int:
    """Write ``rows`` sorted by ``(archive, member)`` (loose files first) as parquet, each caption cut to
    ``caption_max_chars`` (flagged in :data:`TRUNCATED_COLUMN`, as is a row that comes flagged); return how many
    were cut.

    ``min_width``/``min_height``: size rules the re-shard step applies (images inside archives).
    """
    keys = [(r["archive"] is not None, r["archive"] or "", r["member"]) for r in rows]
    if len(set(keys)) != len(keys):
        raise AssertionError("adapter wrote the same (archive, member) twice")
    cut = 0
    for r in rows:  # a row may come flagged already (its caption file was read only as far as the limit)
        r["caption"], cut_now = cut_caption(r["caption"], caption_max_chars)
        r[TRUNCATED_COLUMN] = cut_now or r.get(TRUNCATED_COLUMN, False)
        cut += r[TRUNCATED_COLUMN]
    ordered = [rows[i] for i in sorted(range(len(rows)), key=keys.__getitem__)]
    table = pa.Table.from_pylist(ordered, schema=ROW_SCHEMA)
    checks = {"min_width": min_width, "min_height": min_height}
    table = table.replace_schema_metadata({RESHARD_CHECKS_KEY: json.dumps(checks, sort_keys=True).encode()})
    with naming_write_faults(out_file, "the filtered rows", setting="paths.filtered"):
        pq.write_table(table, out_file)
    return cut


def reshard_checks(filtered: Path) -> dict[str, int | None]:
    """The size rules stored by :func:`write_rows` (``None`` values when absent)."""
    metadata = pq.read_schema(filtered).metadata or {}
    stored = json.loads(metadata.get(RESHARD_CHECKS_KEY, b"{}"))
    return {"min_width": stored.get("min_width"), "min_height": stored.get("min_height")}


def inside(path: Path, root: Path) -> bool:
    """``path`` resolves (symlinks followed) to a location under ``root``; False for a symlink loop."""
    return resolves_inside(path, root)


def stem_key(rel: str) -> str:
    """A loose image's identity: its relative path without the suffix (``a.jpg`` and ``a.png`` collide)."""
    return rel.rsplit(".", 1)[0]
