"""The caption files' format: ``paths.captions/<source>/<shard>.parquet``, one row per sample of the shard's tar
(written by :mod:`sdforge.captions.shards`, read by ``encode_latents``). Kept free of model code: the encode stage
reads these files and nothing else of the captioning package."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

INPUT_SHA256 = b"sdforge.input_sha256"
"""The parquet's metadata key naming the sha256 of the tar it was captioned from."""
SCHEMA = pa.schema(
    [("key", pa.string()), ("image_sha256", pa.string()), ("original_caption", pa.string()),
     ("synthetic_caption", pa.string()), ("generated", pa.string()), ("rejected", pa.string()),
     ("model", pa.string()), ("revision", pa.string()), ("prompt_sha256", pa.string()), ("settings", pa.string()),
     ("tokens", pa.int32()), ("truncated", pa.bool_())]
)  # fmt: skip
"""``synthetic_caption`` is the caption to train with (the original where ``rejected`` names why); ``generated``
the model's own text; ``settings`` the fingerprint of model, revision, prompt and generation settings."""


def read_captions(captions_dir: Path, shard_stem: str) -> dict[str, str] | None:
    """``key → synthetic caption`` of one shard; None when ``captions_dir`` has no parquet for it."""
    path = captions_dir / f"{shard_stem}.parquet"
    if not path.is_file():
        return None
    table = pq.read_table(path, columns=["key", "synthetic_caption"])
    return dict(zip(table["key"].to_pylist(), table["synthetic_caption"].to_pylist(), strict=True))
