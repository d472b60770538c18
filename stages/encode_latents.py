"""Stage ``encode_latents@<source>``: WebDataset shards → VAE latents + token ids in latent shards.

One folder per bucket set the source is encoded at (``encode.resolutions``, names under ``buckets``):
``${paths.latents}/<source>/<resolution>/``. Every image goes to its nearest bucket (aspect ratio),
resized to cover it and centre-cropped (:mod:`sdforge.ingest.buckets`); per input tar ``NNNNN.tar``:

- ``shard-NNNNN-WxH.safetensors`` per bucket W×H used: ``latents`` fp16 ``[N, C, H/f, W/f]`` (posterior
  mean × scaling factor), ``input_ids`` int32 ``[N, 77]``, and ``synthetic_ids`` when ``caption_images`` wrote
  synthetic captions for the tar (``paths.captions/<source>/NNNNN.parquet``; a change of them redoes the
  shard); ``__metadata__``: the input tar (name, size,
  sha256), the encoder fingerprint (VAE + tokenizer files, skip policy, precision), the sample count and
  the bad-sample counts;
- ``shard-NNNNN.parquet``: that tar's manifest rows with the same metadata, written after them;
- ``manifest.parquet``: every part concatenated, written last. Columns: ``key, caption, source, shard,
  bucket_width, bucket_height, row`` (in the bucket's file), ``width, height`` (as found in the tar),
  ``original_width, original_height`` (from the sample's JSON), ``resized_width, resized_height`` and
  ``crop_left/top/right/bottom`` (the crop box in the resized image: SDXL crop conditioning),
  ``resized, truncated``.

Kill-safe: each file is written to a temp name and renamed. A rerun keeps a shard when its files exist
and agree (:func:`sdforge.latents.store.check_shard`), their metadata names the same input (name, size
and sha256 — ETag for s3:// inputs) and the same encoder, and the bucket set still gives each sample
the bucket and crop it has; it re-encodes every other shard (so a bucket-set change re-encodes only the
tars it moves a sample of, and only in that resolution's folder). The outputs are a function of the
inputs' bytes only (no mtimes, no timings), so DVC sees the same hashes run to run. The pipeline itself
is :mod:`sdforge.latents.pipeline`.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from model.precision import encode_precision
from sdforge.captions.store import read_captions
from sdforge.config import Encode, Params
from sdforge.ingest.buckets import Size, shapes_of
from sdforge.io import InputError, atomic_write_bytes, require_writable, stage_cli
from sdforge.latents import s3_inputs
from sdforge.latents import store as store
from sdforge.latents.encoded import (
    COUNT_KEYS,
    MANIFEST_SCHEMA,
    captions_digest,
    clean_stale,
    encode_and_write,
    encoder_fingerprint,
    reusable,
)
from sdforge.latents.inputs import list_inputs
from sdforge.tracking import log_stage

log = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when available, else ``cpu``."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def open_out_dir(out_dir: Path, shards: set[int]) -> None:
    """Check that ``out_dir`` can be written (else one :class:`~sdforge.io.OutputError` line, before any encoding),
    create it, and remove a killed run's temp files and the shards of input tars that are gone."""
    require_writable(out_dir, "latents", setting="paths.latents")
    out_dir.mkdir(parents=True, exist_ok=True)
    clean_stale(out_dir, shards)


def run(
    cfg: Encode, source: str, shard_dir: str | Path, models_dir: Path, out_dir: Path, buckets: list[Size] | None = None,
    captions_dir: Path | None = None, max_pixels: int | None = None, max_caption_chars: int | None = None,
) -> dict:
    """Encode every input tar of ``shard_dir`` not already encoded under ``out_dir`` at ``buckets`` (default:
    square ``cfg.resolution``), with the synthetic captions of ``captions_dir`` (caption_images); return metrics."""
    t0 = time.perf_counter()
    buckets = buckets or [(cfg.resolution, cfg.resolution)]
    models_dir, out_dir = Path(models_dir), Path(out_dir)
    device = resolve_device(cfg.device)
    precision = encode_precision(torch.device(device), cfg.mixed_precision)
    tars = list_inputs(shard_dir)
    encoder = encoder_fingerprint(models_dir, cfg, precision, buckets)
    open_out_dir(out_dir, {t.shard for t in tars})
    captions = {t.shard: read_captions(captions_dir, Path(t.name).stem) if captions_dir else None for t in tars}
    digests = {shard: captions_digest(c) for shard, c in captions.items()}
    with ThreadPoolExecutor(4) as pool:  # hashing the inputs of finished shards: disk-bound, GIL released
        checked = pool.map(lambda t: reusable(t, out_dir, encoder, buckets, digests[t.shard]), tars)
        parts = {t.shard: done for t, done in zip(tars, checked, strict=True) if done is not None}
    todo = [t for t in tars if t.shard not in parts]
    log.info("%s: %d input tars, %d already encoded, %d to encode", shard_dir, len(tars), len(parts), len(todo))
    stats: Counter = Counter()
    if todo:
        (out_dir / store.MANIFEST).unlink(missing_ok=True)
        written = encode_and_write(
            cfg, source, todo, models_dir, out_dir, device, precision, encoder, stats, buckets, captions, max_pixels,
            max_caption_chars,
        )
        parts.update(written)
    tables = [parts[t.shard][0] for t in tars]
    manifest = pa.concat_tables(tables) if tables else MANIFEST_SCHEMA.empty_table()
    if manifest.num_rows == 0:
        raise InputError(f"{shard_dir}: shards hold no decodable samples")
    buf = io.BytesIO()
    pq.write_table(manifest, buf)
    atomic_write_bytes(out_dir / store.MANIFEST, buf.getvalue())
    totals = Counter()
    for t in tars:
        totals.update(json.loads(parts[t.shard][1]["counts"]))
    per_bucket = store.part_buckets(manifest)
    first = next(t for t in tars if int(parts[t.shard][1]["samples"]))
    first_bucket = next(iter(store.part_buckets(parts[first.shard][0])))
    header, _ = store.read_header(out_dir / store.shard_name(first.shard, first_bucket))
    return {
        "samples": manifest.num_rows,
        "buckets": {f"{w}x{h}": n for (w, h), n in per_bucket.items()},
        "shards": len(tars),
        "shards_encoded": len(todo),
        "shards_reused": len(tars) - len(todo),
        "latent_shape": header["latents"]["shape"][1:],
        **{k: int(totals.get(k, 0)) for k in COUNT_KEYS},
        "device": device,
        "precision": precision,
        "decode_workers": cfg.decode_workers,
        "images_encoded": int(stats["images"]),
        "images_per_second": round(stats["images"] / stats["pipeline_seconds"], 2) if stats["images"] else None,
        "encode_wait_fraction": round(stats["wait_seconds"] / stats["pipeline_seconds"], 4) if todo else None,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _shard_dir(shards: str, source: str) -> str | Path:
    return f"{shards.rstrip('/')}/{source}" if s3_inputs.is_s3(shards) else Path(shards) / source


def run_resolutions(params: Params, source: str) -> dict:
    """:func:`run` at each of ``params``' encoded bucket sets, into ``paths.latents/<source>/<resolution>``.

    Metrics: the first set's, plus ``<resolution>.samples`` / ``.shards_encoded`` / ``.buckets`` for each;
    shards encoded and reused and seconds summed over the sets; ``images_per_second`` = source images
    encoded per second of pipeline time over all sets (each image is encoded once per set)."""
    paths, sets = params.paths, params.bucket_sets()
    metrics: dict = {}
    pipeline_s = 0.0
    for name in params.encoded_resolutions():
        out = store.resolution_dir(Path(paths.latents), source, name)
        shapes = shapes_of(sets[name])
        captions = Path(paths.captions) / source
        bounds = params.sources[source].fetch.max_image_pixels, params.sources[source].fetch.max_caption_chars
        shards = _shard_dir(paths.shards, source)
        got = run(params.encode, source, shards, Path(paths.models), out, shapes, captions, *bounds)
        for key in ("samples", "shards_encoded", "buckets", "images_per_second"):
            metrics[f"{name}.{key}"] = got[key]
        if got["images_per_second"]:
            pipeline_s += got["images_encoded"] / got["images_per_second"]
        if "samples" not in metrics:
            metrics.update(got, resolution=name)
            continue
        for key in ("shards_encoded", "shards_reused", "seconds"):
            metrics[key] = round(metrics[key] + got[key], 2)
        metrics["images_encoded"] = max(metrics["images_encoded"], got["images_encoded"])
    metrics["images_per_second"] = round(metrics["images_encoded"] / pipeline_s, 2) if pipeline_s else None
    return metrics


def run_stage(params: Params, source: str) -> dict:
    """Resolve source ``source``'s paths from ``params``, run at every encoded resolution, log to MLflow."""
    metrics = run_resolutions(params, source)

    sets = ", ".join(f"{r} {metrics[f'{r}.buckets']}" for r in params.encoded_resolutions())
    note = f"- encode `{source}`: {metrics['samples']} latents per resolution ({metrics['precision']}); buckets: {sets}"
    headline = ("samples", "images_per_second")
    log_stage(
        params.tracking,
        "data",
        f"encode_latents@{source}",
        metrics,
        params.encode.model_dump(),
        headline=headline,
        note=note,
    )
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.encode_latents --params params.yaml --item <source>``."""
    stage_cli("encode_latents", run_stage, argv=argv)


if __name__ == "__main__":
    main()
