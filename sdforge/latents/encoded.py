"""The encode stage's output shards, one per input tar: listing the inputs, deciding which finished shards
are still current (same encoder fingerprint, same input bytes), encoding the rest through
:func:`sdforge.latents.pipeline.encode_shards` and writing each shard with its manifest part.
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
from sdforge.io import InputError
from sdforge.latents import s3_inputs
from sdforge.latents import store as store
from sdforge.latents.inputs import TarInput
from sdforge.latents.pipeline import EncodedShard, Options, encode_shards

log = logging.getLogger(__name__)

FORMAT = "sdforge-latents/1"
MANIFEST_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("caption", pa.string()),
        ("source", pa.string()),
        ("shard", pa.int64()),
        ("row", pa.int64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("original_width", pa.int32()),
        ("original_height", pa.int32()),
        ("resized", pa.bool_()),
        ("truncated", pa.bool_()),
    ]
)
ROW_FIELDS = ("key", "caption", "width", "height", "original_width", "original_height", "resized", "truncated")
"""Manifest columns the pipeline fills per sample; the stage adds source, shard, row."""
COUNT_KEYS = (
    "skipped_no_image",
    "skipped_corrupt",
    "skipped_wrong_size",
    "skipped_duplicate_key",
    "tar_errors",
    "resized",
    "captions_empty",
    "captions_truncated",
)


def list_inputs(shard_dir: str | Path) -> list[TarInput]:
    """The input tars, sorted; shard number = the tar's numeric stem (else its position)."""
    if s3_inputs.is_s3(str(shard_dir)):
        found = s3_inputs.list_tars(str(shard_dir))
    else:
        found = [(p.name, str(p), p.stat().st_size, None) for p in Path(shard_dir).glob("*.tar")]
    if not found:
        raise InputError(f"{shard_dir}: no .tar shards found (did fetch_images run?)")
    found.sort()
    stems = [name.removesuffix(".tar") for name, *_ in found]
    numeric = all(s.isdigit() for s in stems) and len({int(s) for s in stems}) == len(stems)
    return [
        TarInput(int(stem) if numeric else i, name, path, size, etag)
        for i, (stem, (name, path, size, etag)) in enumerate(zip(stems, found, strict=True))
    ]


def encoder_fingerprint(models_dir: Path, cfg: Encode, precision: str) -> str:
    """sha256 of the VAE and tokenizer files and the settings that change the output."""
    h = hashlib.sha256(json.dumps([FORMAT, cfg.resolution, cfg.wrong_size, precision]).encode())
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


def reusable(tar: TarInput, out_dir: Path, encoder: str) -> tuple[pa.Table, dict] | None:
    """The shard's manifest part and metadata if it is complete and current, else None (logged why)."""
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
    elif (meta.get("input_etag") == tar.etag) if tar.etag else (meta.get("input_sha256") == sha256_file(tar.path)):
        return table, meta
    else:
        why = f"{tar.name} changed"
    log.warning("shard %d is redone: %s", tar.shard, why)
    return None


def clean_stale(out_dir: Path, keep: set[int]) -> None:
    """Remove temp files of a killed run and shards whose input tar is gone."""
    for path in out_dir.glob(".*.tmp"):
        path.unlink(missing_ok=True)
    for pattern in (store.SHARD_PATTERN, store.PART_PATTERN):
        for path in out_dir.glob(pattern):
            number = path.name.split(".")[0].removeprefix("shard-")
            if not number.isdigit() or int(number) not in keep:
                log.warning("%s: no input tar for it any more; removed", path)
                path.unlink()


def write_encoded(
    out_dir: Path, enc: EncodedShard, source: str, encoder: str, scaling_factor: float
) -> tuple[pa.Table, dict[str, str]]:
    """Write one shard's safetensors, then its manifest part; return the part's rows and metadata."""
    n = len(enc.rows)
    columns = {name: [r[name] for r in enc.rows] for name in MANIFEST_SCHEMA.names if name in ROW_FIELDS}
    columns.update(source=[source] * n, shard=[enc.tar.shard] * n, row=list(range(n)))
    table = pa.Table.from_pydict({name: columns[name] for name in MANIFEST_SCHEMA.names}, schema=MANIFEST_SCHEMA)
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
    if enc.tar.etag:
        meta["input_etag"] = enc.tar.etag
    part, sf = out_dir / store.part_name(enc.tar.shard), out_dir / store.shard_name(enc.tar.shard)
    part.unlink(missing_ok=True)
    if n:
        store.write_shard_sorted(sf, enc.latents, enc.input_ids, meta)
    else:
        sf.unlink(missing_ok=True)
    store.write_part(part, table, meta)
    return table, meta


def encode_and_write(
    cfg: Encode, source: str, todo: list[TarInput], models_dir: Path, out_dir: Path, device: str, precision: str,
    encoder: str, stats: Counter,
) -> dict:
    """Run the pipeline over ``todo``, writing each shard as it completes; return its parts."""
    vae = AutoencoderKL.from_pretrained(models_dir / "vae")
    tokenizer = CLIPTokenizer.from_pretrained(models_dir / "tokenizer")
    opts = Options(
        batch_size=cfg.batch_size,
        resolution=cfg.resolution,
        wrong_size=cfg.wrong_size,
        decode_workers=cfg.decode_workers,
        prefetch_shards=cfg.prefetch_shards,
        device=device,
        bf16=precision == "bf16",
        channels_last=cfg.channels_last,
        compile=cfg.compile,
    )
    parts, sf = {}, scaling_factor(vae)

    def write(enc: EncodedShard) -> None:
        parts[enc.tar.shard] = write_encoded(out_dir, enc, source, encoder, sf)
        log.info("shard %d (%s): %d samples encoded", enc.tar.shard, enc.tar.name, len(enc.rows))

    pa.array([""])  # pyarrow imports pandas on its first list conversion (~0.3 s of CPU): not during the encode
    t0 = time.perf_counter()
    pending = None  # one shard is written (fsync included) while the next one is encoded
    with tempfile.TemporaryDirectory(prefix="encode-inputs-") as tmp, ThreadPoolExecutor(1) as writer:
        for enc in encode_shards(todo, vae, tokenizer, opts, stats, tmp_dir=tmp):
            if pending is not None:
                pending.result()
            pending = writer.submit(write, enc)
        if pending is not None:
            pending.result()
    stats["pipeline_seconds"] = time.perf_counter() - t0
    return parts
