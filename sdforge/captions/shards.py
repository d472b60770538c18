"""Caption the images of WebDataset shards: one parquet per shard, resumable, cached by image content.

:func:`caption_shards` reads each ``*.tar`` of a fetched source, keys every image by its sha256, captions only the
images without a caption under the current settings (:mod:`sdforge.captions.cache`) — taken from the earlier
outputs in the same folder — and writes ``<shard>.parquet`` atomically once the shard is done. A killed run
resumes at the first shard without its parquet; a run with other settings recaptions all and counts them as stale.
An unreadable image, one over ``fetch.max_image_pixels`` (its header is read before any pixel is decoded) or a
rejected generation keeps the original caption and is counted by reason; one bad image never fails its shard.

Columns: key, image_sha256, original_caption, synthetic_caption (the caption to use: the original where rejected),
generated (the model's text), rejected (reason or null), model, revision, prompt_sha256, settings (fingerprint),
tokens (CLIP token count of the generation), truncated (over the token cap). The file's metadata names the input
tar's sha256: a shard re-fetched with other images is captioned again, one whose tar is gone is removed.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdforge.bounds.captions import cut_caption, decode_caption
from sdforge.bounds.images import ImageRejected, check_header
from sdforge.captions.cache import plan_captions
from sdforge.captions.captioner import Caption, judge_captions
from sdforge.captions.store import INPUT_SHA256, SCHEMA
from sdforge.ingest.shards import read_tar
from sdforge.io import atomic_file

log = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
UNREADABLE = "unreadable_image"
TOO_LARGE = "too_large"
"""An image whose header declares more than ``fetch.max_image_pixels``, or a side over :data:`MAX_SIDE`."""
MAX_SIDE = 65_500
"""The longest side the fetch stage writes (docs/FETCH.md); a longer one is not captioned."""
Generate = Callable[[Sequence[np.ndarray]], list[str]]
"""Images (RGB, HWC uint8) → the model's text for each: a bound :func:`sdforge.captions.captioner.generate`."""


@dataclass
class CaptionStats:
    """What a run did, for the stage's metrics."""

    shards_done: int = 0
    shards_skipped: int = 0
    shards_removed: int = 0
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
    max_pixels: int | None = None
    """The source's ``fetch.max_image_pixels``: a bigger image is not decoded (:data:`TOO_LARGE`)."""
    max_caption_chars: int | None = None
    """The source's ``fetch.max_caption_chars``: an original caption is read, and a generated one judged and
    stored, cut to it (:mod:`sdforge.bounds.captions`)."""

    @property
    def prompt_sha256(self) -> str:
        return hashlib.sha256(self.prompt.encode()).hexdigest()


def _decode(data: bytes, max_pixels: int | None) -> tuple[np.ndarray | None, str | None]:
    """``(RGB image, None)``, or ``(None, reason)``: :data:`TOO_LARGE` for a header over ``max_pixels`` (checked
    before any pixel is decoded) or a side over :data:`MAX_SIDE` (fetch writes neither), else :data:`UNREADABLE`."""
    if max_pixels is not None:
        try:
            check_header(data, max_pixels)
        except ImageRejected:
            return None, TOO_LARGE
    try:
        image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    except cv2.error:  # an empty buffer, among others
        image = None
    if image is None or image.size == 0:
        return None, UNREADABLE
    if max(image.shape[:2]) > MAX_SIDE:
        return None, TOO_LARGE
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB), None


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
        texts = [cut_caption(t, run.max_caption_chars)[0] for t in run.generate([todo[s] for s in batch])]
        judged = judge_captions(texts, [originals[s] for s in batch], run.prompt, run.count_tokens, run.max_tokens)
        out.update(zip(batch, judged, strict=True))
    return out


Progress = Callable[[int, int, int], None]
"""``(shards finished, shards to caption, images captioned)`` after each captioned shard."""


def caption_shard(tar: Path, out: Path, earlier: dict[str, dict], run: Captioning, stats: CaptionStats) -> None:
    """Caption one shard into ``out`` (a parquet), reusing ``earlier`` captions made with the same settings."""
    tar_sha = sha256_file(tar)
    samples = read_tar(tar)
    keyed, originals, images, unusable = [], {}, {}, {}
    for key in sorted(samples):
        data = _image_bytes(samples[key])
        sha = hashlib.sha256(data or b"").hexdigest()
        original = decode_caption(samples[key].get("txt", b""), run.max_caption_chars)[0]
        keyed.append((key, sha, original))  # the caption belongs to the sample, the generation to the image
        originals.setdefault(sha, original)
        image, problem = _decode(data, run.max_pixels) if data else (None, UNREADABLE)
        if image is None:
            stats.rejected[problem] += 1
            unusable[sha] = problem
        else:
            images[sha] = image
    done = {sha: row["settings"] for sha, row in earlier.items()}
    plan = plan_captions([sha for _, sha, _ in keyed if sha in images], done, run.fingerprint)
    new = _caption_new({sha: images[sha] for sha in plan.todo}, originals, run)
    stats.images += len(keyed)
    stats.captioned, stats.cached, stats.stale = (
        stats.captioned + len(new),
        stats.cached + plan.cached,
        stats.stale + plan.stale,
    )
    rows = []
    for key, sha, original in keyed:
        rows.append(_row(key, sha, original, new.get(sha), earlier.get(sha), unusable.get(sha), run, stats))
    table = pa.Table.from_pylist(rows, schema=SCHEMA).replace_schema_metadata({INPUT_SHA256: tar_sha.encode()})
    with atomic_file(out) as fh:
        pq.write_table(table, fh)


def sha256_file(path: Path) -> str:
    """The file's sha256 (hex)."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _row(key, sha, original, caption, earlier_row, unusable, run: Captioning, stats: CaptionStats) -> dict:
    if caption is not None:  # shared by every sample of the same image bytes: a rejection keeps each one's own
        generated, rejected, tokens = caption.generated, caption.rejected, caption.tokens
        text = original if rejected else caption.text
        if rejected:
            stats.rejected[rejected] += 1
    elif unusable is None and earlier_row is not None:
        generated, rejected, tokens = (earlier_row[k] for k in ("generated", "rejected", "tokens"))
        text = original if rejected else earlier_row["synthetic_caption"]
    else:
        text, generated, rejected, tokens = original, "", unusable or UNREADABLE, 0
    truncated = tokens > run.max_tokens
    stats.truncated += truncated
    return {"key": key, "image_sha256": sha, "original_caption": original, "synthetic_caption": text,
            "generated": generated, "rejected": rejected, "model": run.model, "revision": run.revision,
            "prompt_sha256": run.prompt_sha256, "settings": run.fingerprint, "tokens": tokens,
            "truncated": truncated}  # fmt: skip


def is_current(out: Path, tar: Path, fingerprint: str) -> bool:
    """True if ``out`` holds ``tar``'s captions (same tar bytes) made with the settings ``fingerprint``."""
    if not out.exists():
        return False
    try:
        meta = pq.read_schema(out).metadata or {}
        settings = set(pq.read_table(out, columns=["settings"]).column("settings").to_pylist())
    except (OSError, pa.ArrowException) as err:
        log.warning("%s: unreadable (%s); captioned again", out, err)
        return False
    return settings <= {fingerprint} and meta.get(INPUT_SHA256) == sha256_file(tar).encode()


def remove_orphans(out_dir: Path, tars: list[Path]) -> int:
    """Delete the parquets (and temp files of a killed run) of ``out_dir`` without a tar; how many parquets."""
    stems = {t.stem for t in tars}
    for tmp in out_dir.glob(".*.tmp"):
        tmp.unlink()
    orphans = [p for p in out_dir.glob("*.parquet") if p.stem not in stems]
    for path in orphans:
        log.warning("%s: its shard is gone; removed", path)
        path.unlink()
    return len(orphans)


def caption_shards(
    shards_dir: Path, out_dir: Path, run: Captioning, on_progress: Progress | None = None
) -> CaptionStats:
    """Caption every ``*.tar`` of ``shards_dir`` into ``out_dir/<shard>.parquet``; shards whose parquet is current
    (:func:`is_current`) are skipped (resume), parquets without a tar removed. Returns the counts."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tars = sorted(shards_dir.glob("*.tar"))
    earlier, stats = _earlier_captions(out_dir), CaptionStats()
    stats.shards_removed = remove_orphans(out_dir, tars)
    todo = [t for t in tars if not is_current(out_dir / f"{t.stem}.parquet", t, run.fingerprint)]
    stats.shards_skipped = len(tars) - len(todo)
    for tar in todo:
        caption_shard(tar, out_dir / f"{tar.stem}.parquet", earlier, run, stats)
        stats.shards_done += 1
        if on_progress:
            on_progress(stats.shards_done, len(todo), stats.captioned)
    return stats


class EtaLog:
    """A :data:`Progress` callback that logs ``shards k/n, images captioned, img/s, ETA`` (and passes it on)."""

    def __init__(self, name: str, then: Callable[[dict], None] | None = None):
        self.name, self.then, self.t0 = name, then, time.perf_counter()

    def __call__(self, done: int, total: int, images: int) -> None:
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (total - done)
        rate = images / elapsed if elapsed > 0 else 0.0
        log.info("%s: shard %d/%d (%.0f%%), %d image(s) captioned, %.2f img/s, ETA %.0f s",
                 self.name, done, total, 100 * done / total, images, rate, eta)  # fmt: skip
        if self.then:
            self.then({"progress": done / total, "eta_s": eta, "images_per_second": rate, "captioned": images})
