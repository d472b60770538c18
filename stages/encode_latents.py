"""Stage ``encode_latents@<source>``: WebDataset shards → VAE latents + token ids in latent shards.

Output ``${paths.latents}/<source>/``:
- ``shard-NNNNN.safetensors``: ``latents`` fp16 ``[N, C, h, w]`` (posterior mean × scaling
  factor) and ``input_ids`` int32 ``[N, 77]``;
- ``manifest.parquet``: ``key, caption, source, shard, row, width, height, truncated``.
Each shard is written to a temp name and renamed.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import polars as pl
import torch
from safetensors.torch import save as safetensors_save

from stages.common import InputError, atomic_write_bytes, stage_cli
from stages.config import Encode, Params
from stages.shards import read_tar

log = logging.getLogger(__name__)

MANIFEST = "manifest.parquet"


@dataclass(frozen=True)
class Sample:
    """One decoded image and its caption from a WebDataset shard."""

    key: str
    caption: str
    image: np.ndarray


def iter_shard_samples(shard_dir: Path, counts: dict[str, int]) -> Iterator[Sample]:
    """Yield samples of every ``*.tar`` in ``shard_dir`` (sorted), skipping and counting bad ones."""
    tars = sorted(shard_dir.glob("*.tar"))
    if not tars:
        raise InputError(f"{shard_dir}: no .tar shards found (did fetch_images run?)")
    for tar_path in tars:
        groups = read_tar(tar_path)
        for key in sorted(groups):
            sample = _decode(tar_path, key, groups[key], counts)
            if sample is not None:
                yield sample


def _decode(tar_path: Path, key: str, files: dict[str, bytes], counts: dict[str, int]) -> Sample | None:
    if "jpg" not in files:
        counts["skipped_no_image"] += 1
        log.warning("%s: sample %s has no .jpg; skipped", tar_path, key)
        return None
    bgr = cv2.imdecode(np.frombuffer(files["jpg"], np.uint8), cv2.IMREAD_COLOR)
    if bgr is None:
        counts["skipped_corrupt"] += 1
        log.warning("%s: sample %s: image does not decode; skipped", tar_path, key)
        return None
    caption = files.get("txt", b"").decode("utf-8", errors="replace")
    return Sample(key=key, caption=caption, image=cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB))


def _batches(samples: Iterator[Sample], size: int) -> Iterator[list[Sample]]:
    batch: list[Sample] = []
    for s in samples:
        batch.append(s)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenize(tokenizer, captions: list[str]) -> tuple[torch.Tensor, list[bool]]:
    """Token ids ``[B, max_len]`` (int32) and, per caption, whether it was truncated."""
    full = tokenizer(captions, truncation=False).input_ids
    ids = tokenizer(
        captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids
    return ids.to(torch.int32), [len(f) > tokenizer.model_max_length for f in full]


def _write_shard(out_dir: Path, index: int, latents: list[torch.Tensor], ids: list[torch.Tensor]) -> str:
    name = f"shard-{index:05d}.safetensors"
    tensors = {"latents": torch.cat(latents).to(torch.float16).contiguous(), "input_ids": torch.cat(ids).contiguous()}
    atomic_write_bytes(out_dir / name, safetensors_save(tensors))
    return name


def run(cfg: Encode, source: str, shard_dir: Path, models_dir: Path, out_dir: Path) -> dict:
    """Encode every sample of ``shard_dir`` into latent shards under ``out_dir``; return metrics."""
    from diffusers import AutoencoderKL
    from transformers import CLIPTokenizer

    from model.latents import encode_latents, images_to_tensor

    device = (
        "cuda"
        if cfg.device == "auto" and torch.cuda.is_available()
        else ("cpu" if cfg.device == "auto" else cfg.device)
    )
    vae = AutoencoderKL.from_pretrained(models_dir / "vae").to(device).eval()
    tokenizer = CLIPTokenizer.from_pretrained(models_dir / "tokenizer")
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {"skipped_no_image": 0, "skipped_corrupt": 0}
    rows: list[dict] = []
    pending_latents: list[torch.Tensor] = []
    pending_ids: list[torch.Tensor] = []
    shard_index, in_shard = 0, 0
    for batch in _batches(iter_shard_samples(shard_dir, counts), cfg.batch_size):
        latents = encode_latents(vae, images_to_tensor([s.image for s in batch])).cpu()
        ids, truncated = tokenize(tokenizer, [s.caption for s in batch])
        for i, s in enumerate(batch):
            rows.append(
                {
                    "key": s.key,
                    "caption": s.caption,
                    "source": source,
                    "shard": shard_index,
                    "row": in_shard + i,
                    "width": s.image.shape[1],
                    "height": s.image.shape[0],
                    "truncated": truncated[i],
                }
            )
        pending_latents.append(latents)
        pending_ids.append(ids)
        in_shard += len(batch)
        if in_shard >= cfg.shard_size:
            _write_shard(out_dir, shard_index, pending_latents, pending_ids)
            shard_index, in_shard, pending_latents, pending_ids = shard_index + 1, 0, [], []
    if pending_latents:
        _write_shard(out_dir, shard_index, pending_latents, pending_ids)
        shard_index += 1
    if not rows:
        raise InputError(f"{shard_dir}: shards hold no decodable samples")
    atomic_write_bytes(out_dir / MANIFEST, _parquet_bytes(pl.DataFrame(rows)))
    latent_shape = list(latents.shape[1:])
    return {
        "samples": len(rows),
        "shards": shard_index,
        "latent_shape": latent_shape,
        "captions_truncated": int(sum(r["truncated"] for r in rows)),
        **counts,
    }


def _parquet_bytes(df: pl.DataFrame) -> bytes:
    buf = io.BytesIO()
    df.write_parquet(buf)
    return buf.getvalue()


def _run_stage(params: Params, source: str) -> dict:
    paths = params.paths
    metrics = run(params.encode, source, Path(paths.shards) / source, Path(paths.models), Path(paths.latents) / source)
    from stages.tracking import log_stage

    log_stage(params.tracking, "data", f"encode_latents@{source}", metrics, params.encode.model_dump())
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.encode_latents --params params.yaml --item <source>``."""
    stage_cli("encode_latents", _run_stage, argv=argv)


if __name__ == "__main__":
    main()
