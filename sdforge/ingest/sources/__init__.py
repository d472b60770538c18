"""Source adapters: one module per source kind that is read from local files rather than URLs.

Each adapter turns the files ``download_metadata`` put in ``paths.metadata/<source>/`` into the
rows of ``filtered.parquet`` (:mod:`sdforge.ingest.sources.rows`: ``archive, member, caption, meta``);
``fetch_images`` then re-shards the images those rows name (:mod:`sdforge.ingest.reshard`). ``laion`` is
not here: its rows are URLs, filtered in :mod:`sdforge.ingest.sources.laion` and fetched with img2dataset.
Formats, row schema and drop reasons per kind: ``sdforge/ingest/sources/README.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sdforge.config import Source
from sdforge.ingest.sources.coco import filter_coco
from sdforge.ingest.sources.diffusiondb import filter_diffusiondb
from sdforge.ingest.sources.journeydb import filter_journeydb
from sdforge.ingest.sources.local import filter_local
from sdforge.ingest.sources.vggface2 import filter_vggface2
from sdforge.io import InputError

LOCAL_KINDS = frozenset({"diffusiondb", "journeydb", "vggface2", "coco", "local"})
FILTERED_FILE = "filtered.parquet"
"""What ``filter_metadata`` writes into ``paths.filtered/<source>/`` and ``fetch_images`` reads."""


def filter_source(source: Source, name: str, in_dir: Path, out_file: Path) -> dict[str, Any]:
    """Write the filtered rows of local source ``name`` to ``out_file``; return the filter metrics."""
    kind, rules, cap = source.kind, source.filter, source.fetch.max_caption_chars
    if kind == "diffusiondb":
        return filter_diffusiondb(in_dir, out_file, rules, source.inputs, max_caption_chars=cap)
    if kind == "journeydb":
        return filter_journeydb(in_dir, out_file, source.journeydb, rules, source.inputs, max_caption_chars=cap)
    if kind == "vggface2":
        return filter_vggface2(
            in_dir, out_file, source.vggface2, rules, source.fetch.max_image_pixels, max_caption_chars=cap
        )
    if kind == "coco":
        return filter_coco(in_dir, out_file, source.coco, rules, source.inputs, max_caption_chars=cap)
    if kind == "local":
        return filter_local(
            in_dir, out_file, source.local, rules, source.fetch.max_image_pixels, source.inputs, max_caption_chars=cap
        )
    raise InputError(f"sources.{name}.kind: '{kind}' has no filter adapter (supported: laion, {sorted(LOCAL_KINDS)})")
