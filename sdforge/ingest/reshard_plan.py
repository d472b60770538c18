"""Which filtered row goes into which re-sharded shard, under which sample key.

Rows (:mod:`sdforge.ingest.sources.rows`: ``archive, member, caption, meta``), validated and sorted by
``(archive, member)``, fill shards of ``fetch.shard_size`` in order; the rows of a tar archive
(``.tar``, ``.tgz``, ``.tar.gz``, ...) start a shard of their own, so that one worker streams that
archive once (``r|*``, no random access into a compressed tar) and writes its shards. Zip members
and loose files are read at random, one worker task per shard. Shard ids and keys (img2dataset's
scheme) come from the plan alone: the output does not depend on ``fetch.processes``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from sdforge.ingest import shards
from sdforge.ingest.archive_members import STREAM_SUFFIXES, ZIP_SUFFIXES, is_stream_archive
from sdforge.ingest.sources.rows import ROW_COLUMNS
from sdforge.io import InputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Item:
    """One filtered row with its sample key."""

    key: str
    archive: str | None
    member: str | None
    caption: str
    meta: str


@dataclass(frozen=True)
class ShardPlan:
    shard_id: int
    archive: str | None
    """The tar archive every item comes from, or None (zip members / loose files, read at random)."""
    items: tuple[Item, ...]


def plan_shards(rows: list[dict[str, Any]], shard_size: int) -> list[ShardPlan]:
    """Rows (sorted) → shards; each tar archive's rows start a new shard. Keys: img2dataset's scheme."""
    plans: list[ShardPlan] = []
    current: list[dict[str, Any]] = []
    group: str | None = None

    def flush() -> None:
        shard_id = len(plans)
        items = tuple(
            Item(
                shards.sample_key(shard_id * shard_size + i, shard_size)[1],
                r["archive"],
                r["member"],
                r["caption"],
                r["meta"],
            )
            for i, r in enumerate(current)
        )
        plans.append(ShardPlan(shard_id, group, items))
        current.clear()

    for row in rows:
        row_group = row["archive"] if is_stream_archive(row["archive"]) else None
        if current and (row_group != group or len(current) == shard_size):
            flush()
        group = row_group
        current.append(row)
    if current:
        flush()
    return plans


def load_rows(filtered: Path, caption_max_chars: int | None = None) -> list[dict[str, Any]]:
    """The filtered rows, validated: the schema, a JSON-object ``meta``, a known archive type. A caption over
    ``max_caption_chars`` (a parquet the filter stage did not write: it cuts them) is cut, with a warning."""
    df = pl.read_parquet(filtered)
    missing = [c for c in ROW_COLUMNS if c not in df.columns]
    if missing:
        raise InputError(
            f"{filtered}: columns {missing} missing (has {df.columns}; expected {list(ROW_COLUMNS)}); "
            "re-run filter_metadata"
        )
    df = df.select(ROW_COLUMNS).with_columns(pl.col("caption").fill_null(""), pl.col("meta").fill_null("{}"))
    if caption_max_chars is not None:
        over = int((df["caption"].str.len_chars() > caption_max_chars).sum())
        if over:
            log.warning(
                "%s: %d captions over sources.<s>.fetch.max_caption_chars (%d) cut (re-run filter_metadata: "
                "it cuts and flags them)", filtered, over, caption_max_chars,
            )  # fmt: skip
            df = df.with_columns(pl.col("caption").str.slice(0, caption_max_chars))
    rows = df.sort(pl.col("archive").is_not_null(), "archive", "member", maintain_order=True).to_dicts()
    for i, row in enumerate(rows):
        try:
            meta = json.loads(row["meta"])
        except json.JSONDecodeError as err:
            raise InputError(f"{filtered}: row {i} (member {row['member']!r}): meta is not JSON ({err})") from None
        if not isinstance(meta, dict):
            raise InputError(f"{filtered}: row {i} (member {row['member']!r}): meta is not a JSON object")
        archive = row["archive"]
        if archive is not None and not archive.lower().endswith(STREAM_SUFFIXES + ZIP_SUFFIXES):
            raise InputError(
                f"{filtered}: row {i}: archive {archive!r} is neither a zip nor a tar ({', '.join(STREAM_SUFFIXES)})"
            )
    return rows
