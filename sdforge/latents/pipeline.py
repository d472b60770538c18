"""The overlapped encode pipeline: input tars → decoded, resized images → token ids → VAE latents.

Four stages run at once, joined by bounded queues (OpenCV, file reads, hashlib and torch release
the GIL, so threads overlap)::

    reader thread    streams each tar (sha256 on the fly; the next ``prefetch_shards`` tars are
                     read ahead or downloaded), groups members by key and submits one decode
                     job per 8 samples, in order, to
    decode pool      ``decode_workers`` threads: imdecode, resize to cover the nearest bucket +
                     centre crop (:mod:`sdforge.ingest.buckets`), BGR→RGB
    batcher thread   takes the jobs' results in submission order, tokenizes the captions
                     (cached), stacks ``batch_size`` images of one bucket into a uint8 tensor
                     (pinned on CUDA)
    caller's thread  uploads, encodes (bf16 autocast + channels_last on CUDA), keeps fp16 latents
                     per bucket; yields one :class:`EncodedShard` per input tar

Batches never span two tars nor two buckets, and results are consumed in submission order, so the
output does not depend on the number of workers, nor on which tars an interrupted run had finished.
The input side (tar stream, decoding, tokenizing) is :mod:`sdforge.latents.inputs`, the read-ahead
and S3 downloads :mod:`sdforge.latents.prefetch`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from model.latents import encode_latents, uint8_to_model_range
from model.precision import AUTOCAST_DTYPES
from sdforge.ingest.buckets import Size
from sdforge.io import InputError
from sdforge.latents.inputs import Decoded, HashingReader, TarInput, Tokens, decode_chunk, iter_tar_groups
from sdforge.latents.prefetch import Prefetcher

log = logging.getLogger(__name__)

_POLL_S = 0.1
_CHUNK = 8
"""Samples per decode job."""
_ROW_FIELDS = (
    "key", "caption", "synthetic", "width", "height", "original_width", "original_height", "resized", "bucket",
    "resized_to", "crop",
)
"""A row's fields taken from its :class:`~sdforge.latents.inputs.Decoded` sample (then ``truncated``)."""


@dataclass(frozen=True)
class Options:
    """What the pipeline needs from ``Encode`` plus the resolved device and precision."""

    batch_size: int
    buckets: tuple[Size, ...]
    wrong_size: str = "resize"
    decode_workers: int = 4
    prefetch_shards: int = 2
    device: str = "cpu"
    precision: str = "fp32"
    """The encoder's autocast: ``bf16``, ``fp16`` or ``fp32`` (none); the stage's choice, model.precision."""
    channels_last: bool = False
    compile: bool = False
    max_pixels: int | None = None
    """``fetch.max_image_pixels`` of the source: a bigger image (header, or its bucket resize) is skipped."""
    max_caption_chars: int | None = None
    """``fetch.max_caption_chars`` of the source: a longer caption is cut before it is tokenized (counted)."""


@dataclass
class BucketLatents:
    """One bucket's samples of one input tar: fp16 latents ``[N, C, h, w]``, int32 token ids, rows; the synthetic
    captions' token ids when the tar has synthetic captions."""

    latents: torch.Tensor
    input_ids: torch.Tensor
    rows: list[dict]
    synthetic_ids: torch.Tensor | None = None


@dataclass
class EncodedShard:
    """One input tar's output: per bucket (sorted), its latents, token ids and rows; the tar's counts."""

    tar: TarInput
    sha256: str
    buckets: dict[Size, BucketLatents]
    counts: Counter = field(default_factory=Counter)

    @property
    def rows(self) -> list[dict]:
        """Every sample's row, bucket by bucket (sorted), in tar order within a bucket."""
        return [row for part in self.buckets.values() for row in part.rows]


@dataclass
class _Batch:
    bucket: Size
    images: torch.Tensor
    input_ids: torch.Tensor
    rows: list[dict]
    synthetic_ids: torch.Tensor | None


@dataclass
class _TarEnd:
    tar: TarInput
    sha256: str
    counts: Counter


class _Failed:
    def __init__(self, err: BaseException):
        self.err = err


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _get(q: queue.Queue, stop: threading.Event):
    while True:
        try:
            item = q.get(timeout=_POLL_S)
        except queue.Empty:
            if stop.is_set():
                raise RuntimeError("encode pipeline stopped") from None
            continue
        if isinstance(item, _Failed):
            raise item.err
        return item


def _thread(target: Callable, out: queue.Queue, stop: threading.Event, name: str) -> threading.Thread:
    def body():
        try:
            target()
        except BaseException as err:  # noqa: BLE001 — handed to the consumer, which re-raises it
            _put(out, _Failed(err), stop)

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread


def encode_shards(
    tars: list[TarInput],
    vae,
    tokenizer,
    opts: Options,
    stats: Counter | None = None,
    tmp_dir: str | None = None,
    captions: Callable[[TarInput], dict[str, str] | None] | None = None,
) -> Iterator[EncodedShard]:
    """Encode ``tars`` in order, one :class:`EncodedShard` per tar; ``stats`` gets seconds spent per stage.
    ``captions(tar)``: the tar's synthetic captions by key (caption_images), or None; their token ids are stored
    beside the originals' (a sample without one gets its original's).

    ``stats["encode_seconds"]`` is the VAE's busy time on this thread, ``stats["wait_seconds"]`` the
    time it waited for a batch (≈ 0 when decode keeps up).
    """
    stats = Counter() if stats is None else stats
    if not tars:
        return
    feeder = _BatchFeeder(tars, tokenizer, opts, tmp_dir, captions)
    feeder.start()
    try:  # a failing VAE set-up (device, compile) must stop the input threads too
        encoder = _encoder(vae, opts, feeder.device)
        yield from _encode_batches(feeder, encoder, stats)
    finally:
        feeder.close()


def _encode_batches(
    feeder: _BatchFeeder, encoder: Callable[[torch.Tensor], torch.Tensor], stats: Counter
) -> Iterator[EncodedShard]:
    """The caller's thread: encode each batch, yield a tar's :class:`EncodedShard` at its end marker."""
    done: dict[Size, list[_Batch]] = {}
    while True:
        t0 = time.perf_counter()
        item = _get(feeder.batches, feeder.stop)
        t1 = time.perf_counter()
        stats["wait_seconds"] += t1 - t0
        if isinstance(item, _Batch):
            item.images = encoder(item.images)  # the batch now carries its latents
            check_finite(item.images, item.rows, feeder.opts.precision)
            done.setdefault(item.bucket, []).append(item)
            stats["encode_seconds"] += time.perf_counter() - t1
            stats["images"] += len(item.rows)
            continue
        parts = {
            bucket: BucketLatents(
                torch.cat([b.images for b in batches]).cpu(),
                torch.cat([b.input_ids for b in batches]),
                [row for b in batches for row in b.rows],
                _cat_synthetic(batches),
            )
            for bucket, batches in sorted(done.items())
        }
        yield EncodedShard(item.tar, item.sha256, parts, item.counts)
        done = {}
        if item.tar is feeder.tars[-1]:
            return


def check_finite(latents: torch.Tensor, rows: list[dict], precision: str) -> None:
    """An :class:`~sdforge.io.InputError` naming the samples whose latents are not finite, and what to change."""
    bad = ~torch.isfinite(latents.flatten(1)).all(dim=1)
    if not bool(bad.any()):
        return
    keys = [row["key"] for row, b in zip(rows, bad.tolist(), strict=True) if b]
    fix = ("the VAE overflows fp16 (SDXL's does): set encode.mixed_precision: bf16 (or no), or models.vae to an "
           "fp16-safe VAE such as madebyollin/sdxl-vae-fp16-fix" if precision == "fp16" else
           "the VAE itself returned NaN/inf on these images: check models.vae and the images")  # fmt: skip
    raise InputError(f"encode: {len(keys)} of {len(rows)} samples' latents are not finite under "
                     f"encode.mixed_precision {precision} (keys {keys[:5]}): {fix}")  # fmt: skip


class _BatchFeeder:
    """The reader thread, decode pool and batcher thread that fill ``batches`` for the encoder.

    ``decoded`` holds decode jobs in submission order and a :class:`_TarEnd` after each tar; ``batches``
    holds :class:`_Batch` es and the same markers. A failing thread puts :class:`_Failed` on its output.
    """

    def __init__(self, tars: list[TarInput], tokenizer, opts: Options, tmp_dir: str | None, captions=None):
        self.tars, self.opts, self.captions = tars, opts, captions
        self.stop = threading.Event()
        depth = max(2 * opts.batch_size // _CHUNK, 4 * opts.decode_workers)  # decode jobs in flight
        self.decoded: queue.Queue = queue.Queue(maxsize=depth)
        self.batches: queue.Queue = queue.Queue(maxsize=2)
        self.pool = ThreadPoolExecutor(opts.decode_workers, thread_name_prefix="decode")
        self.prefetch = Prefetcher(tars, opts.prefetch_shards, tmp_dir)
        self.device = torch.device(opts.device)
        self.tokens = Tokens(tokenizer)
        self.threads: list[threading.Thread] = []

    def start(self) -> None:
        """Start the reader and batcher threads."""
        self.threads = [
            _thread(self._read, self.decoded, self.stop, "encode-reader"),
            _thread(self._batch, self.batches, self.stop, "encode-batcher"),
        ]

    def close(self) -> None:
        """Stop both threads, cancel pending decode jobs, wait for everything, stop the prefetcher."""
        self.stop.set()
        self.pool.shutdown(wait=True, cancel_futures=True)
        for thread in self.threads:
            thread.join()
        self.prefetch.close()

    def _read(self) -> None:
        """Reader thread: each tar's samples as decode jobs of ``_CHUNK``, then its end marker."""
        for i, tar in enumerate(self.tars):
            local = self.prefetch.local_path(i)
            counts, digest, chunk = Counter(), hashlib.sha256(), []
            synthetic = self.captions(tar) if self.captions else None
            with open(local, "rb", buffering=1 << 20) as raw:
                fh = HashingReader(raw, digest)
                for sample in iter_tar_groups(fh, counts, self.opts.max_caption_chars, self.opts.max_pixels):
                    chunk.append(sample)
                    if len(chunk) == _CHUNK:
                        if not self._submit(chunk, synthetic):
                            return
                        chunk = []
                fh.drain()
            self.prefetch.done(local)
            end = _TarEnd(tar, digest.hexdigest(), counts)
            if (chunk and not self._submit(chunk, synthetic)) or not _put(self.decoded, end, self.stop):
                return

    def _submit(self, chunk: list, synthetic: dict[str, str] | None) -> bool:
        """Queue a decode job for ``chunk`` (``synthetic``: the tar's synthetic captions); False once stopped."""
        opts = self.opts
        job = self.pool.submit(
            decode_chunk, chunk, opts.buckets, opts.wrong_size, synthetic, opts.max_pixels, opts.max_caption_chars
        )
        return _put(self.decoded, job, self.stop)

    def _batch(self) -> None:
        """Batcher thread: decoded samples, in order, into batches that never span two tars nor two buckets."""
        pending: dict[Size, list[Decoded]] = {}
        tally = Counter()  # the tar's per-sample counts (skipped, resized, captions), kept off the VAE's thread
        while True:
            item = _get(self.decoded, self.stop)
            if isinstance(item, _TarEnd):
                if not self._end_tar(item, pending, tally) or item.tar is self.tars[-1]:
                    return
                pending, tally = {}, Counter()
            elif not self._add_samples(item.result(), pending, tally):
                return

    def _add_samples(self, samples: list[Decoded], pending: dict[Size, list[Decoded]], tally: Counter) -> bool:
        """Append decoded ``samples`` to their bucket's ``pending`` list, put each full batch; False once stopped."""
        for sample in samples:
            if sample.image is None:
                tally[f"skipped_{sample.problem}"] += 1
                log.warning("sample %s skipped: %s", sample.key, sample.problem)
                continue
            group = pending.setdefault(sample.bucket, [])
            group.append(sample)
            if len(group) == self.opts.batch_size:
                if not _put(self.batches, _make_batch(group, self.tokens, self.device, tally), self.stop):
                    return False
                group.clear()  # _make_batch keeps no reference to the list
        return True

    def _end_tar(self, end: _TarEnd, pending: dict[Size, list[Decoded]], tally: Counter) -> bool:
        """Put the tar's last, short batch of each bucket, then its end marker (with the tar's counts); False once
        stopped."""
        for bucket in sorted(pending):
            group = pending[bucket]
            if group and not _put(self.batches, _make_batch(group, self.tokens, self.device, tally), self.stop):
                return False
        end.counts.update(tally)
        return _put(self.batches, end, self.stop)


def _make_batch(samples: list[Decoded], tokens: Tokens, device: torch.device, counts: Counter) -> _Batch:
    """Stack ``samples`` into a batch; add their resized / truncated / empty-caption counts to ``counts``."""
    ids, truncated = tokens([s.caption for s in samples])
    synthetic_ids = None
    if any(s.synthetic is not None for s in samples):
        synthetic_ids, cut = tokens([s.caption if s.synthetic is None else s.synthetic for s in samples])
        counts["captions_synthetic"] += sum(s.synthetic is not None for s in samples)
        counts["synthetic_truncated"] += sum(c and s.synthetic is not None for s, c in zip(samples, cut, strict=True))
    counts["resized"] += sum(s.resized for s in samples)
    counts["captions_truncated"] += sum(truncated)
    counts["captions_cut"] += sum(s.caption_cut for s in samples)
    counts["captions_empty"] += sum(not s.caption.strip() for s in samples)
    images = torch.from_numpy(np.stack([s.image for s in samples]))
    if device.type == "cuda":
        images = images.pin_memory()
    rows = [
        {**{f: getattr(s, f) for f in _ROW_FIELDS}, "truncated": t} for s, t in zip(samples, truncated, strict=True)
    ]
    return _Batch(samples[0].bucket, images, ids, rows, synthetic_ids)


def _cat_synthetic(batches: list[_Batch]) -> torch.Tensor | None:
    """A bucket's synthetic token ids over its batches (the originals' for a batch without any), or None."""
    if all(b.synthetic_ids is None for b in batches):
        return None
    return torch.cat([b.input_ids if b.synthetic_ids is None else b.synthetic_ids for b in batches])


def _encoder(vae, opts: Options, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """``uint8 [B, H, W, 3]`` → fp16 latents on ``device`` (posterior mean × scaling factor)."""
    cuda = device.type == "cuda"
    channels_last = opts.channels_last and cuda
    vae = vae.to(device).eval().requires_grad_(False)
    if channels_last:
        vae = vae.to(memory_format=torch.channels_last)
    if opts.compile:  # one graph per bucket shape (a handful): dynamic shapes would cost more than the recompiles
        vae.encoder = torch.compile(vae.encoder, dynamic=False)
    dtype = AUTOCAST_DTYPES.get(opts.precision)
    autocast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

    def encode(images: torch.Tensor) -> torch.Tensor:
        n = images.shape[0]
        if opts.compile and n < opts.batch_size:  # one static shape: no recompile for a tar's last batch
            images = torch.cat([images, images.new_zeros((opts.batch_size - n, *images.shape[1:]))])
        x = uint8_to_model_range(images.to(device, non_blocking=True), channels_last)
        with torch.inference_mode(), autocast:
            return encode_latents(vae, x)[:n].to(torch.float16)

    return encode
