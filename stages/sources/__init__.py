"""Source adapters: one module per source kind that is read from local files rather than URLs.

Each adapter turns the files ``download_metadata`` put in ``paths.metadata/<source>/`` into the
rows of ``filtered.parquet`` (:mod:`stages.sources.rows`: ``archive, member, caption, meta``);
``fetch_images`` then re-shards the images those rows name (:mod:`stages.reshard`). ``laion`` is
not here: its rows are URLs, filtered in :mod:`stages.filter_metadata` and fetched with img2dataset.
Formats, row schema and drop reasons per kind: ``stages/sources/README.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.common import InputError
from stages.config import Source

LOCAL_KINDS = frozenset({"diffusiondb", "journeydb", "vggface2", "coco", "local"})


def filter_source(source: Source, name: str, in_dir: Path, out_file: Path) -> dict[str, Any]:
    """Write the filtered rows of local source ``name`` to ``out_file``; return the filter metrics."""
    kind, rules = source.kind, source.filter
    if kind == "diffusiondb":
        from stages.sources.diffusiondb import filter_diffusiondb

        return filter_diffusiondb(in_dir, out_file, rules)
    if kind == "journeydb":
        from stages.sources.journeydb import filter_journeydb

        return filter_journeydb(in_dir, out_file, source.journeydb, rules)
    if kind == "vggface2":
        from stages.sources.vggface2 import filter_vggface2

        return filter_vggface2(in_dir, out_file, source.vggface2, rules)
    if kind == "coco":
        from stages.sources.coco import filter_coco

        return filter_coco(in_dir, out_file, source.coco, rules)
    if kind == "local":
        from stages.sources.local import filter_local

        return filter_local(in_dir, out_file, source.local, rules)
    raise InputError(f"sources.{name}.kind: '{kind}' has no filter adapter (supported: laion, {sorted(LOCAL_KINDS)})")
