"""Stage ``encode_latents@<source>``: WebDataset shards → VAE latents + token ids in latent shards.

Output ``${paths.latents}/<source>/`` (format in :mod:`stages.latent_store`), one latent shard per
input tar ``NNNNN.tar``:

- ``shard-NNNNN.safetensors``: ``latents`` fp16 ``[N, C, h, w]`` (posterior mean × scaling factor),
  ``input_ids`` int32 ``[N, 77]``; ``__metadata__``: the input tar (name, size, sha256), the
  encoder fingerprint (VAE + tokenizer files, resolution, skip policy, precision), the sample count
  and the bad-sample counts;
- ``shard-NNNNN.parquet``: that shard's manifest rows with the same metadata, written after it;
- ``manifest.parquet``: every part concatenated, written last. Columns: ``key, caption, source,
  shard, row, width, height`` (as found in the tar), ``original_width, original_height`` (from the
  sample's JSON), ``resized, truncated``.

Kill-safe: each file is written to a temp name and renamed. A rerun keeps a shard when both files
exist and agree (:func:`stages.latent_store.check_shard`) and their metadata names the same input
(name, size and sha256 — ETag for s3:// inputs) and the same encoder; it re-encodes every other
shard. The outputs are a function of the inputs' bytes only (no mtimes, no timings), so DVC sees
the same hashes run to run. The pipeline itself is :mod:`stages.encode_pipeline`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages import latent_store as store
from stages import s3_inputs
from stages.common import InputError, atomic_write_bytes, stage_cli
from stages.config import Encode, Params
from stages.encode_pipeline import EncodedShard, Options, TarInput, encode_shards

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


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _reusable(tar: TarInput, out_dir: Path, encoder: str) -> tuple[pa.Table, dict] | None:
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
    elif (meta.get("input_etag") == tar.etag) if tar.etag else (meta.get("input_sha256") == _sha256(tar.path)):
        return table, meta
    else:
        why = f"{tar.name} changed"
    log.warning("shard %d is redone: %s", tar.shard, why)
    return None


def _clean(out_dir: Path, keep: set[int]) -> None:
    """Remove temp files of a killed run and shards whose input tar is gone."""
    for path in out_dir.glob(".*.tmp"):
        path.unlink(missing_ok=True)
    for pattern in (store.SHARD_PATTERN, store.PART_PATTERN):
        for path in out_dir.glob(pattern):
            number = path.name.split(".")[0].removeprefix("shard-")
            if not number.isdigit() or int(number) not in keep:
                log.warning("%s: no input tar for it any more; removed", path)
                path.unlink()


def _write(
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


def resolve_device(device: str) -> str:
    """``auto`` → ``cuda`` when available, else ``cpu``."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def run(cfg: Encode, source: str, shard_dir: str | Path, models_dir: Path, out_dir: Path) -> dict:
    """Encode every input tar of ``shard_dir`` not already encoded under ``out_dir``; return metrics."""
    t0 = time.perf_counter()
    models_dir, out_dir = Path(models_dir), Path(out_dir)
    device = resolve_device(cfg.device)
    precision = "bf16" if device == "cuda" and cfg.mixed_precision == "bf16" else "fp32"
    tars = list_inputs(shard_dir)
    encoder = encoder_fingerprint(models_dir, cfg, precision)
    out_dir.mkdir(parents=True, exist_ok=True)
    _clean(out_dir, {t.shard for t in tars})
    with ThreadPoolExecutor(4) as pool:  # hashing the inputs of finished shards: disk-bound, GIL released
        checked = pool.map(lambda t: _reusable(t, out_dir, encoder), tars)
        parts = {t.shard: done for t, done in zip(tars, checked, strict=True) if done is not None}
    todo = [t for t in tars if t.shard not in parts]
    log.info("%s: %d input tars, %d already encoded, %d to encode", shard_dir, len(tars), len(parts), len(todo))
    stats: Counter = Counter()
    if todo:
        (out_dir / store.MANIFEST).unlink(missing_ok=True)
        parts.update(_encode(cfg, source, todo, models_dir, out_dir, device, precision, encoder, stats))
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
    first = next(t for t in tars if int(parts[t.shard][1]["samples"]))
    header, _ = store.read_header(out_dir / store.shard_name(first.shard))
    return {
        "samples": manifest.num_rows,
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


def _encode(cfg, source, todo, models_dir, out_dir, device, precision, encoder, stats) -> dict:
    """Run the pipeline over ``todo``, writing each shard as it completes; return its parts."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTokenizer

    from model.latents import scaling_factor

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
        parts[enc.tar.shard] = _write(out_dir, enc, source, encoder, sf)
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


def _shard_dir(shards: str, source: str) -> str | Path:
    return f"{shards.rstrip('/')}/{source}" if s3_inputs.is_s3(shards) else Path(shards) / source


def _run_stage(params: Params, source: str) -> dict:
    paths = params.paths
    metrics = run(
        params.encode, source, _shard_dir(paths.shards, source), Path(paths.models), Path(paths.latents) / source
    )
    from stages.tracking import log_stage

    log_stage(params.tracking, "data", f"encode_latents@{source}", metrics, params.encode.model_dump())
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.encode_latents --params params.yaml --item <source>``."""
    stage_cli("encode_latents", _run_stage, argv=argv)


if __name__ == "__main__":
    main()
