"""The overlapped encode pipeline: input tars → decoded, resized images → token ids → VAE latents.

Four stages run at once, joined by bounded queues (OpenCV, file reads, hashlib and torch release
the GIL, so threads overlap)::

    reader thread    streams each tar (sha256 on the fly; the next ``prefetch_shards`` tars are
                     read ahead or downloaded), groups members by key and submits one decode
                     job per 8 samples, in order, to
    decode pool      ``decode_workers`` threads: imdecode, resize + centre crop, BGR→RGB
    batcher thread   takes the jobs' results in submission order, tokenizes the captions
                     (cached), stacks ``batch_size`` images into a uint8 tensor (pinned on CUDA)
    caller's thread  uploads, encodes (bf16 autocast + channels_last on CUDA), keeps fp16 latents;
                     yields one :class:`EncodedShard` per input tar

Batches never span two tars and results are consumed in submission order, so the output does
not depend on the number of workers, nor on which tars an interrupted run had finished.
The input side (tar stream, decoding, tokenizing) is :mod:`stages.encode_inputs`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from model.latents import encode_latents, uint8_to_model_range
from stages.encode_inputs import Decoded, HashingReader, Tokens, decode_chunk, iter_tar_groups

log = logging.getLogger(__name__)

_POLL_S = 0.1
_CHUNK = 8
"""Samples per decode job."""


@dataclass(frozen=True)
class TarInput:
    """One input tar: output shard number, name, where to read it (local path or s3:// URL), size."""

    shard: int
    name: str
    path: str
    size: int
    etag: str | None = None
    """S3 only: the object's ETag (lets a rerun check a finished shard without downloading its input)."""


@dataclass(frozen=True)
class Options:
    """What the pipeline needs from ``Encode`` plus the resolved device and precision."""

    batch_size: int
    resolution: int
    wrong_size: str = "resize"
    decode_workers: int = 4
    prefetch_shards: int = 2
    device: str = "cpu"
    bf16: bool = False
    channels_last: bool = False
    compile: bool = False


@dataclass
class EncodedShard:
    """One input tar's output: fp16 latents (None if no sample survived), int32 token ids, rows, counts."""

    tar: TarInput
    sha256: str
    latents: torch.Tensor | None
    input_ids: torch.Tensor | None
    rows: list[dict]
    counts: Counter = field(default_factory=Counter)


@dataclass
class _Batch:
    images: torch.Tensor
    input_ids: torch.Tensor
    rows: list[dict]


@dataclass
class _TarEnd:
    tar: TarInput
    sha256: str
    counts: Counter


class _Failed:
    def __init__(self, err: BaseException):
        self.err = err


class _Prefetcher:
    """Makes input ``i`` local: the next ``ahead`` files are fadvise(WILLNEED)d, s3:// objects downloaded."""

    def __init__(self, tars: list[TarInput], ahead: int, tmp_dir: str | None):
        self.tars, self.ahead, self.tmp_dir = tars, ahead, tmp_dir
        self.s3 = any(t.path.startswith("s3://") for t in tars)
        self.pool = ThreadPoolExecutor(max(1, ahead), thread_name_prefix="prefetch") if self.s3 else None
        self.jobs: dict[int, Future] = {}
        self.started: set[int] = set()

    def local_path(self, i: int) -> str:
        for j in range(i, min(i + self.ahead + 1, len(self.tars))):
            if j not in self.started:
                self.started.add(j)
                self._start(j)
        return self.jobs.pop(i).result() if self.s3 else self.tars[i].path

    def _start(self, j: int) -> None:
        tar = self.tars[j]
        if self.s3:
            self.jobs[j] = self.pool.submit(_download, tar.path, os.path.join(self.tmp_dir, f"{j}-{tar.name}"))
        elif hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):
                fd = os.open(tar.path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                finally:
                    os.close(fd)

    def done(self, local: str) -> None:
        if self.s3:
            with contextlib.suppress(OSError):
                os.unlink(local)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _download(url: str, dest: str) -> str:
    from stages.s3_inputs import download

    download(url, dest)
    return dest


# ------------------------------------------------------------------------------------ pipeline


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
    tars: list[TarInput], vae, tokenizer, opts: Options, stats: Counter | None = None, tmp_dir: str | None = None
) -> Iterator[EncodedShard]:
    """Encode ``tars`` in order, one :class:`EncodedShard` per tar; ``stats`` gets seconds spent per stage.

    ``stats["encode_seconds"]`` is the VAE's busy time on this thread, ``stats["wait_seconds"]`` the
    time it waited for a batch (≈ 0 when decode keeps up).
    """
    stats = Counter() if stats is None else stats
    stop = threading.Event()
    depth = max(2 * opts.batch_size // _CHUNK, 4 * opts.decode_workers)  # decode jobs in flight
    decoded: queue.Queue = queue.Queue(maxsize=depth)
    batches: queue.Queue = queue.Queue(maxsize=2)
    pool = ThreadPoolExecutor(opts.decode_workers, thread_name_prefix="decode")
    prefetch = _Prefetcher(tars, opts.prefetch_shards, tmp_dir)
    device = torch.device(opts.device)
    tokens = Tokens(tokenizer)

    def read() -> None:
        def submit(chunk: list) -> bool:
            return not chunk or _put(decoded, pool.submit(decode_chunk, chunk, opts.resolution, opts.wrong_size), stop)

        for i, tar in enumerate(tars):
            local = prefetch.local_path(i)
            counts, digest, chunk = Counter(), hashlib.sha256(), []
            with open(local, "rb", buffering=1 << 20) as raw:
                fh = HashingReader(raw, digest)
                for sample in iter_tar_groups(fh, counts):
                    chunk.append(sample)
                    if len(chunk) == _CHUNK:
                        if not submit(chunk):
                            return
                        chunk = []
                fh.drain()
            prefetch.done(local)
            if not submit(chunk) or not _put(decoded, _TarEnd(tar, digest.hexdigest(), counts), stop):
                return

    def batch() -> None:
        pending: list[Decoded] = []
        tally = Counter()  # the tar's per-sample counts (skipped, resized, captions), kept off the VAE's thread
        while True:
            item = _get(decoded, stop)
            if isinstance(item, _TarEnd):
                if pending and not _put(batches, _make_batch(pending, tokens, device, tally), stop):
                    return
                item.counts.update(tally)
                pending, tally = [], Counter()
                if not _put(batches, item, stop) or item.tar is tars[-1]:
                    return
                continue
            for sample in item.result():
                if sample.image is None:
                    tally[f"skipped_{sample.problem}"] += 1
                    log.warning("sample %s skipped: %s", sample.key, sample.problem)
                    continue
                pending.append(sample)
                if len(pending) == opts.batch_size:
                    if not _put(batches, _make_batch(pending, tokens, device, tally), stop):
                        return
                    pending = []

    if not tars:
        return
    threads = [_thread(read, decoded, stop, "encode-reader"), _thread(batch, batches, stop, "encode-batcher")]
    encoder = _encoder(vae, opts, device)
    try:
        latents, ids, rows = [], [], []
        while True:
            t0 = time.perf_counter()
            item = _get(batches, stop)
            t1 = time.perf_counter()
            stats["wait_seconds"] += t1 - t0
            if isinstance(item, _Batch):
                latents.append(encoder(item.images))
                ids.append(item.input_ids)
                rows += item.rows
                stats["encode_seconds"] += time.perf_counter() - t1
                stats["images"] += len(item.rows)
                continue
            yield EncodedShard(
                item.tar,
                item.sha256,
                torch.cat(latents).cpu() if latents else None,
                torch.cat(ids) if ids else None,
                rows,
                item.counts,
            )
            latents, ids, rows = [], [], []
            if item.tar is tars[-1]:
                return
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        for thread in threads:
            thread.join()
        prefetch.close()


def _make_batch(samples: list[Decoded], tokens: Tokens, device: torch.device, counts: Counter) -> _Batch:
    """Stack ``samples`` into a batch; add their resized / truncated / empty-caption counts to ``counts``."""
    ids, truncated = tokens([s.caption for s in samples])
    counts["resized"] += sum(s.resized for s in samples)
    counts["captions_truncated"] += sum(truncated)
    counts["captions_empty"] += sum(not s.caption.strip() for s in samples)
    images = torch.from_numpy(np.stack([s.image for s in samples]))
    if device.type == "cuda":
        images = images.pin_memory()
    rows = [
        {
            "key": s.key,
            "caption": s.caption,
            "width": s.width,
            "height": s.height,
            "original_width": s.original_width,
            "original_height": s.original_height,
            "resized": s.resized,
            "truncated": t,
        }
        for s, t in zip(samples, truncated, strict=True)
    ]
    return _Batch(images, ids, rows)


def _encoder(vae, opts: Options, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """``uint8 [B, H, W, 3]`` → fp16 latents on ``device`` (posterior mean × scaling factor)."""
    cuda = device.type == "cuda"
    channels_last = opts.channels_last and cuda
    vae = vae.to(device).eval().requires_grad_(False)
    if channels_last:
        vae = vae.to(memory_format=torch.channels_last)
    if opts.compile:
        vae.encoder = torch.compile(vae.encoder, dynamic=False)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda and opts.bf16 else contextlib.nullcontext()

    def encode(images: torch.Tensor) -> torch.Tensor:
        n = images.shape[0]
        if opts.compile and n < opts.batch_size:  # one static shape: no recompile for a tar's last batch
            images = torch.cat([images, images.new_zeros((opts.batch_size - n, *images.shape[1:]))])
        x = uint8_to_model_range(images.to(device, non_blocking=True), channels_last)
        with torch.inference_mode(), autocast:
            return encode_latents(vae, x)[:n].to(torch.float16)

    return encode
