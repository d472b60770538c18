"""Caption the images of WebDataset shards: one parquet per shard, resumable, cached by image content.

:func:`caption_shards` reads each ``*.tar`` of a fetched source, keys every image by its sha256, captions only the
images without a caption under the current settings (:mod:`sdforge.captions.cache`) — taken from the earlier
outputs in the same folder — and writes ``<shard>.parquet`` atomically once the shard is done. A killed run
resumes at the first shard without its parquet; a run with other settings recaptions all and counts them as stale.
An unreadable image or a rejected generation keeps the original caption and is counted by reason; one bad image
never fails its shard.

Columns: key, image_sha256, original_caption, synthetic_caption (the caption to use: the original where rejected),
generated (the model's text), rejected (reason or null), model, revision, settings (fingerprint), tokens (CLIP
token count of the generation), truncated (over the token cap).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdforge.captions.cache import plan_captions
from sdforge.captions.captioner import Caption, judge_captions
from sdforge.ingest.shards import read_tar
from sdforge.io import atomic_file

log = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
UNREADABLE = "unreadable_image"
Generate = Callable[[Sequence[np.ndarray]], list[str]]
"""Images (RGB, HWC uint8) → the model's text for each: a bound :func:`sdforge.captions.captioner.generate`."""


@dataclass
class CaptionStats:
    """What a run did, for the stage's metrics."""

    shards_done: int = 0
    shards_skipped: int = 0
    images: int = 0
    captioned: int = 0
    cached: int = 0
    stale: int = 0
    rejected: Counter = field(default_factory=Counter)
    truncated: int = 0

    def as_metrics(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k != "rejected"}
        out.update({f"rejected_{reason}": n for reason, n in sorted(self.rejected.items())})
        out["rejected"] = sum(self.rejected.values())
        return out


@dataclass(frozen=True)
class Captioning:
    """The settings of one run: model identity and fingerprint, prompt, the generation, how tokens are counted."""

    model: str
    revision: str | None
    fingerprint: str
    prompt: str
    generate: Generate
    count_tokens: Callable[[str], int]
    batch_size: int = 16
    max_tokens: int = 77


def _decode(data: bytes) -> np.ndarray | None:
    image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    return None if image is None else cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


def _earlier_captions(out_dir: Path) -> dict[str, dict]:
    """image sha256 → its row in any earlier shard parquet of ``out_dir`` (its settings fingerprint included)."""
    rows: dict[str, dict] = {}
    for path in sorted(out_dir.glob("*.parquet")):
        for row in pq.read_table(path).to_pylist():
            rows[row["image_sha256"]] = row
    return rows


def _image_bytes(sample: dict[str, bytes]) -> bytes | None:
    return next((sample[e] for e in IMAGE_EXTS if e in sample), None)


def _caption_new(todo: dict[str, np.ndarray], originals: dict[str, str], run: Captioning) -> dict[str, Caption]:
    """Captions of the ``todo`` images (sha256 → RGB), in batches."""
    shas, out = list(todo), {}
    for start in range(0, len(shas), run.batch_size):
        batch = shas[start : start + run.batch_size]
        texts = run.generate([todo[s] for s in batch])
        judged = judge_captions(texts, [originals[s] for s in batch], run.prompt, run.count_tokens, run.max_tokens)
        out.update(zip(batch, judged, strict=True))
    return out


def caption_shard(tar: Path, out: Path, earlier: dict[str, dict], run: Captioning, stats: CaptionStats) -> None:
    """Caption one shard into ``out`` (a parquet), reusing ``earlier`` captions made with the same settings."""
    samples = read_tar(tar)
    keyed, originals, images = [], {}, {}
    for key in sorted(samples):
        data = _image_bytes(samples[key])
        sha = hashlib.sha256(data or b"").hexdigest()
        original = samples[key].get("txt", b"").decode("utf-8", errors="replace")
        keyed.append((key, sha))
        originals.setdefault(sha, original)
        image = _decode(data) if data else None
        if image is None:
            stats.rejected[UNREADABLE] += 1
        else:
            images[sha] = image
    done = {sha: row["settings"] for sha, row in earlier.items()}
    plan = plan_captions([sha for _, sha in keyed if sha in images], done, run.fingerprint)
    new = _caption_new({sha: images[sha] for sha in plan.todo}, originals, run)
    stats.images += len(keyed)
    stats.captioned, stats.cached, stats.stale = (
        stats.captioned + len(new),
        stats.cached + plan.cached,
        stats.stale + plan.stale,
    )
    rows = []
    for key, sha in keyed:
        rows.append(_row(key, sha, originals[sha], new.get(sha), earlier.get(sha), sha in images, run, stats))
    with atomic_file(out) as fh:
        pq.write_table(pa.Table.from_pylist(rows), fh)


def _row(key, sha, original, caption, earlier_row, readable, run: Captioning, stats: CaptionStats) -> dict:
    if caption is not None:
        text, generated, rejected, tokens = caption.text, caption.generated, caption.rejected, caption.tokens
        if rejected:
            stats.rejected[rejected] += 1
    elif readable and earlier_row is not None:
        text, generated, rejected, tokens = (
            earlier_row[k] for k in ("synthetic_caption", "generated", "rejected", "tokens")
        )
    else:
        text, generated, rejected, tokens = original, "", UNREADABLE, 0
    stats.truncated += tokens > run.max_tokens
    return {"key": key, "image_sha256": sha, "original_caption": original, "synthetic_caption": text,
            "generated": generated, "rejected": rejected, "model": run.model, "revision": run.revision,
            "settings": run.fingerprint, "tokens": tokens, "truncated": tokens > run.max_tokens}  # fmt: skip


def caption_shards(shards_dir: Path, out_dir: Path, run: Captioning) -> CaptionStats:
    """Caption every ``*.tar`` of ``shards_dir`` into ``out_dir/<shard>.parquet``; shards whose parquet exists with
    the current settings are skipped (resume). Returns the counts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    earlier, stats = _earlier_captions(out_dir), CaptionStats()
    for tar in sorted(shards_dir.glob("*.tar")):
        out = out_dir / f"{tar.stem}.parquet"
        if out.exists() and set(pq.read_table(out, columns=["settings"]).column("settings").to_pylist()) == {
            run.fingerprint
        }:
            stats.shards_skipped += 1
            continue
        caption_shard(tar, out, earlier, run, stats)
        stats.shards_done += 1
        log.info(
            "%s: %d image(s) so far, %d captioned, %d cached", tar.name, stats.images, stats.captioned, stats.cached
        )
    return stats
