"""Source adapters: one module per source kind that is read from local files rather than URLs.

Each adapter turns the files ``download_metadata`` put in ``paths.metadata/<source>/`` into the
rows of ``filtered.parquet``; ``fetch_images`` then re-shards the images those rows name
(:mod:`stages.reshard`). ``laion`` is not here: its rows are URLs, filtered in
:mod:`stages.filter_metadata` and fetched with img2dataset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stages.common import InputError
from stages.config import Source

LOCAL_KINDS = frozenset({"diffusiondb"})


def filter_source(source: Source, name: str, in_dir: Path, out_file: Path) -> dict[str, Any]:
    """Write the filtered rows of local source ``name`` to ``out_file``; return the filter metrics."""
    if source.kind == "diffusiondb":
        from stages.sources import diffusiondb

        return diffusiondb.filter_diffusiondb(in_dir, out_file)
    raise InputError(
        f"sources.{name}.kind: '{source.kind}' has no filter adapter yet (supported: laion, {sorted(LOCAL_KINDS)})"
    )
