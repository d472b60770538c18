"""The encode stage's output shards, per input tar one latent file per bucket plus a manifest part: listing
the inputs, deciding which finished shards are still current (same encoder fingerprint, same input bytes,
and every sample still assigned the bucket and crop it was encoded with), encoding the rest through
:func:`sdforge.latents.pipeline.encode_shards` and writing each shard with its manifest part.

A change of the bucket set re-encodes only the tars with a sample whose bucket or crop box changed: the
assignment is recomputed from the part's recorded image sizes (the input's hash guarantees they are
still the images' sizes), without reading the tar. With ``wrong_size: skip`` the skipped samples are not
in the part, so there the bucket shapes are part of the fingerprint instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
from diffusers import AutoencoderKL
from transformers import CLIPTokenizer

from model.latents import scaling_factor
from sdforge.config import Encode
from sdforge.ingest.buckets import Size, plan
from sdforge.io import InputError
from sdforge.latents import store as store
from sdforge.latents.inputs import TarInput
from sdforge.latents.pipeline import EncodedShard, Options, encode_shards

log = logging.getLogger(__name__)

FORMAT = "sdforge-latents/3"  # 2: one file per (input tar, bucket), bucket and crop columns; 3: synthetic captions
MANIFEST_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("caption", pa.string()),
        ("synthetic_caption", pa.string()),
        ("source", pa.string()),
        ("shard", pa.int64()),
        ("bucket_width", pa.int32()),
        ("bucket_height", pa.int32()),
        ("row", pa.int64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("original_width", pa.int32()),
        ("original_height", pa.int32()),
        ("resized_width", pa.int32()),
        ("resized_height", pa.int32()),
        ("crop_left", pa.int32()),
        ("crop_top", pa.int32()),
        ("crop_right", pa.int32()),
        ("crop_bottom", pa.int32()),
        ("resized", pa.bool_()),
        ("truncated", pa.bool_()),
    ]
)
"""``row`` is the sample's row in its bucket's file; ``width``/``height`` the image as found in the tar,
resized (aspect kept) to ``resized_*`` and cut to the crop box (pixels of the resized image, SDXL's
``crop_coords_top_left`` = (crop_top, crop_left)); ``synthetic_caption`` is null for a sample without one."""
ROW_FIELDS = ("key", "caption", "width", "height", "original_width", "original_height", "resized", "truncated")
"""Manifest columns the pipeline fills per sample as they are; bucket, resized size and crop box are split
into columns, and the stage adds source, shard, row."""
COUNT_KEYS = (
    "skipped_no_image",
    "skipped_corrupt",
    "skipped_wrong_size",
    "skipped_too_large",
    "skipped_duplicate_key",
    "tar_errors",
    "resized",
    "captions_empty",
    "captions_truncated",
    "captions_cut",
    "captions_synthetic",
    "synthetic_truncated",
)


def encoder_fingerprint(models_dir: Path, cfg: Encode, precision: str, buckets: list[Size]) -> str:
    """sha256 of the VAE and tokenizer files and the settings that change the output (the bucket shapes only
    with ``wrong_size: skip``; otherwise :func:`reusable` checks each sample's assignment)."""
    shapes = sorted(buckets) if cfg.wrong_size == "skip" else None
    h = hashlib.sha256(json.dumps([FORMAT, cfg.wrong_size, precision, shapes]).encode())
    for sub in ("vae", "tokenizer"):
        for path in sorted(p for p in (models_dir / sub).rglob("*") if p.is_file()):
            h.update(path.relative_to(models_dir).as_posix().encode() + b"\0")
            with path.open("rb") as fh:
                while chunk := fh.read(1 << 20):
                    h.update(chunk)
    return h.hexdigest()


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def moved_samples(table: pa.Table, buckets: list[Size]) -> int:
    """How many of a part's samples ``buckets`` would put in another bucket or crop box than recorded."""
    cols = {name: table.column(name).to_pylist() for name in ("width", "height", *_PLAN_COLUMNS)}
    moved = 0
    for i, (w, h) in enumerate(zip(cols["width"], cols["height"], strict=True)):
        p = plan(w, h, buckets)
        if (*p.bucket, *p.resized, *p.box) != tuple(cols[name][i] for name in _PLAN_COLUMNS):
            moved += 1
    return moved


_PLAN_COLUMNS = (
    "bucket_width", "bucket_height", "resized_width", "resized_height", "crop_left", "crop_top", "crop_right",
    "crop_bottom",
)


def captions_digest(captions: dict[str, str] | None) -> str:
    """sha256 of a tar's synthetic captions (key → caption), ``""`` for none: a shard is redone when it changes."""
    if not captions:
        return ""
    return hashlib.sha256(json.dumps(sorted(captions.items()), ensure_ascii=False).encode()).hexdigest()


def reusable(
    tar: TarInput, out_dir: Path, encoder: str, buckets: list[Size], captions: str = ""
) -> tuple[pa.Table, dict] | None:
    """The shard's manifest part and metadata if it is complete and current (``captions``: the digest of its
    synthetic captions, :func:`captions_digest`), else None (logged why)."""
    if not (out_dir / store.part_name(tar.shard)).exists():
        return None
    try:
        table, meta = store.check_shard(out_dir, tar.shard)
    except InputError as err:
        log.warning("shard %d is redone: %s", tar.shard, err)
        return None
    if meta.get("encoder") != encoder:
        why = "encoded with another VAE, tokenizer or settings"
    elif meta.get("input") != tar.name or meta.get("input_size") != str(tar.size):
        why = f"its input was {meta.get('input')} of {meta.get('input_size')} bytes"
    elif not _same_input(tar, meta):
        why = f"{tar.name} changed"
    elif meta.get("captions", "") != captions:
        why = "its synthetic captions changed (caption_images)"
    elif moved := moved_samples(table, buckets):
        why = f"the bucket set changed: {moved} of its {table.num_rows} samples get another bucket or crop"
    else:
        return table, meta
    log.warning("shard %d is redone: %s", tar.shard, why)
    return None


def _same_input(tar: TarInput, meta: dict[str, str]) -> bool:
    """The input tar's bytes are those the shard was encoded from (S3: its ETag; else its sha256)."""
    if tar.etag:
        return meta.get("input_etag") == tar.etag
    return meta.get("input_sha256") == sha256_file(tar.path)


def clean_stale(out_dir: Path, keep: set[int]) -> None:
    """Remove temp files of a killed run and shards whose input tar is gone."""
    for path in out_dir.glob(".*.tmp"):
        path.unlink(missing_ok=True)
    for pattern in (store.SHARD_PATTERN, store.PART_PATTERN):
        for path in out_dir.glob(pattern):
            number = store.shard_number(path.name)
            if number is None or number not in keep:
                log.warning("%s: no input tar for it any more; removed", path)
                path.unlink()


def write_encoded(
    out_dir: Path, enc: EncodedShard, source: str, encoder: str, scaling_factor: float, captions: str = ""
) -> tuple[pa.Table, dict[str, str]]:
    """Write one shard's safetensors (one per bucket), then its manifest part; return the part's rows and metadata."""
    rows = enc.rows
    n = len(rows)
    table = pa.Table.from_pydict(_manifest_columns(rows, source, enc), schema=MANIFEST_SCHEMA)
    counts = {k: int(enc.counts.get(k, 0)) for k in COUNT_KEYS}
    meta = {
        "format": FORMAT,
        "source": source,
        "input": enc.tar.name,
        "input_size": str(enc.tar.size),
        "input_sha256": enc.sha256,
        "encoder": encoder,
        "scaling_factor": repr(scaling_factor),
        "samples": str(n),
        "counts": json.dumps(counts, sort_keys=True),
    }
    if captions:
        meta["captions"] = captions
    if enc.tar.etag:
        meta["input_etag"] = enc.tar.etag
    part = out_dir / store.part_name(enc.tar.shard)
    part.unlink(missing_ok=True)
    for old in out_dir.glob(f"shard-{enc.tar.shard:05d}-*.safetensors"):
        old.unlink()
    for bucket, got in enc.buckets.items():
        path = out_dir / store.shard_name(enc.tar.shard, bucket)
        store.write_shard_sorted(path, got.latents, got.input_ids, meta, got.synthetic_ids)
    store.write_part(part, table, meta)
    return table, meta


def _manifest_columns(rows: list[dict], source: str, enc: EncodedShard) -> dict[str, list]:
    """The part's columns from the pipeline's rows (bucket by bucket, as :attr:`EncodedShard.rows` orders them)."""
    n = len(rows)
    columns = {name: [r[name] for r in rows] for name in ROW_FIELDS}
    columns["synthetic_caption"] = [r["synthetic"] for r in rows]
    columns.update(source=[source] * n, shard=[enc.tar.shard] * n)
    columns["row"] = [i for part in enc.buckets.values() for i in range(len(part.rows))]
    columns["bucket_width"], columns["bucket_height"] = [r["bucket"][0] for r in rows], [r["bucket"][1] for r in rows]
    columns["resized_width"] = [r["resized_to"][0] for r in rows]
    columns["resized_height"] = [r["resized_to"][1] for r in rows]
    for i, side in enumerate(("left", "top", "right", "bottom")):
        columns[f"crop_{side}"] = [r["crop"][i] for r in rows]
    return {name: columns[name] for name in MANIFEST_SCHEMA.names}


def encode_and_write(
    cfg: Encode, source: str, todo: list[TarInput], models_dir: Path, out_dir: Path, device: str, precision: str,
    encoder: str, stats: Counter, buckets: list[Size], captions: dict[int, dict[str, str] | None] | None = None,
    max_pixels: int | None = None,
    max_caption_chars: int | None = None,
) -> dict:
    """Run the pipeline over ``todo``, writing each shard as it completes; return its parts. ``captions``: per
    shard number, its synthetic captions by key (or None); ``max_pixels``: the source's
    ``fetch.max_image_pixels`` (not in the encoder fingerprint: the shards' bytes change whenever the fetch
    settings do, and the fetch stage never writes a bigger image); ``max_caption_chars``: the source's
    ``fetch.max_caption_chars`` (not in it either: the filter stage cuts captions to it, so the shards change
    with it)."""
    captions = captions or {}
    vae = AutoencoderKL.from_pretrained(models_dir / "vae")
    tokenizer = CLIPTokenizer.from_pretrained(models_dir / "tokenizer")
    opts = Options(
        batch_size=cfg.batch_size,
        buckets=tuple(buckets),
        wrong_size=cfg.wrong_size,
        decode_workers=cfg.decode_workers,
        prefetch_shards=cfg.prefetch_shards,
        device=device,
        precision=precision,
        channels_last=cfg.channels_last,
        compile=cfg.compile,
        max_pixels=max_pixels,
        max_caption_chars=max_caption_chars,
    )
    parts, sf = {}, scaling_factor(vae)

    def write(enc: EncodedShard) -> None:
        digest = captions_digest(captions.get(enc.tar.shard))
        parts[enc.tar.shard] = write_encoded(out_dir, enc, source, encoder, sf, digest)
        log.info("shard %d (%s): %d samples encoded", enc.tar.shard, enc.tar.name, len(enc.rows))

    pa.array([""])  # pyarrow imports pandas on its first list conversion (~0.3 s of CPU): not during the encode
    t0 = time.perf_counter()
    pending = None  # one shard is written (fsync included) while the next one is encoded
    with tempfile.TemporaryDirectory(prefix="encode-inputs-") as tmp, ThreadPoolExecutor(1) as writer:
        for enc in encode_shards(todo, vae, tokenizer, opts, stats, tmp, lambda t: captions.get(t.shard)):
            if pending is not None:
                pending.result()
            pending = writer.submit(write, enc)
        if pending is not None:
            pending.result()
    stats["pipeline_seconds"] = time.perf_counter() - t0
    return parts
