"""Training data from a phase index over the latent store: deterministic per-epoch, per-rank batches.

:class:`LatentIndexDataset` memory-maps every shard file the index names (one per input tar and bucket,
:func:`sdforge.latents.store.open_shard`: a header read each) and checks that every indexed row exists;
nothing else is read up front. A batch is gathered from the memmaps on request, shard by shard with rows
in ascending order, then put back in the batch's order. Shard pages live in the OS page cache, shared by
every DDP rank on the node.

Every rank sees a disjoint part of the epoch (same number of batches on every rank, so DDP ranks step
together), and iteration can start at any batch offset without touching the skipped batches (mid-epoch
resume). The epoch's order (:func:`rank_batches`) is :func:`sdforge.latents.bucket_batches.plan_epoch`'s: one
global batch (one optimizer step's samples) per step, each from one bucket, so at each step all ranks train on
one shape; a bucket's tail smaller than a global batch is dropped or carried to the next epoch
(``train.bucket_tail``). The order depends on the global batch, never on the world size (elastic resume).
Before issue 22 a one-bucket phase used a permutation strided by rank with a partial last batch.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from sdforge.captions.mix import sample_ids, synthetic_mask
from sdforge.io import InputError
from sdforge.latents.bucket_batches import BatchSplit, plan_epoch, plan_epochs
from sdforge.latents.store import ShardArrays, open_shard, shard_path

log = logging.getLogger(__name__)

_GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: smaller elementwise ops stay on the calling thread
PREFETCH_BATCHES = 4
"""Batches ahead of the current one whose rows :func:`iter_batches` asks the kernel to read in."""


class LatentIndexDataset:
    """The samples a phase index points at, read on demand from memory-mapped latent shards.

    ``buckets`` lists the index's bucket shapes (width, height), sorted; ``sample_bucket[i]`` is sample
    ``i``'s position in it; ``latent_shapes[b]`` is bucket ``b``'s latent shape ``(C, h, w)``."""

    def __init__(self, index_path: Path, latents_dir: Path, resolution: str):
        index_path, latents_dir = Path(index_path), Path(latents_dir)
        index = _read_index(index_path)
        # 1-D np.unique over packed int64 keys: ~10x faster than axis=1 over stacked columns at 100k rows
        buckets, sample_bucket = np.unique((index.bucket_width << 32) | index.bucket_height, return_inverse=True)
        self.buckets: list[tuple[int, int]] = [(int(b >> 32), int(b & 0xFFFFFFFF)) for b in buckets.tolist()]
        self.sample_bucket = sample_bucket.reshape(-1).astype(np.int32)
        # one shard id per (source, shard, bucket), sorted; every row's shard id
        packed = (index.source_code.astype(np.int64) << 56) | (index.shard << 16) | self.sample_bucket
        keys, sid = np.unique(packed, return_inverse=True)
        self._sid = sid.reshape(-1).astype(np.int32)
        keys = np.stack([keys >> 56, (keys >> 16) & (2**40 - 1), keys & 0xFFFF])
        self._row = index.row
        self.sources: list[str] = index.sources
        """The index's source names, sorted; ``source_code[i]`` is sample ``i``'s position in it."""
        self.source_code = index.source_code.astype(np.int16)
        self.shard = index.shard
        """Sample ``i``'s shard number and row in it: ``(sources[source_code[i]], shard[i], row[i])`` names it."""
        self._shards: list[ShardArrays] = []
        self.shard_keys: list[tuple[str, int, tuple[int, int]]] = []
        """Per shard file: ``(source, shard number, bucket)``; :meth:`locate` gives each sample's position in it."""
        self._ids_fetched: set[int] = set()
        self.latent_shapes: dict[int, tuple[int, ...]] = {}
        for sid, (code, shard, bucket) in enumerate(keys.T.tolist()):
            where = (index.sources[code], shard, self.buckets[bucket])
            arrays = _open_checked(index_path, latents_dir, resolution, *where)
            self._check_rows(index_path, latents_dir, resolution, where, arrays, self._row[self._sid == sid])
            self._check_shape(
                index_path, where, arrays, self.latent_shapes.setdefault(bucket, arrays.latents.shape[1:])
            )
            _advise_random(arrays.latents)
            self._shards.append(arrays)
            self.shard_keys.append(where)
        self._row_bytes = [arrays.latents[0].nbytes for arrays in self._shards]
        with_synthetic = np.asarray([a.synthetic_ids is not None for a in self._shards], dtype=bool)
        self.has_synthetic: np.ndarray = with_synthetic[self._sid]
        """Per sample: its shard holds synthetic captions' token ids (a recaptioned source, ``caption_images``)."""
        bucket_sizes = np.asarray(self.buckets, dtype=np.int64).reshape(-1, 2)[self.sample_bucket]
        self.sample_ids: np.ndarray = sample_ids(
            self.sources, self.source_code, self.shard, bucket_sizes[:, 0], bucket_sizes[:, 1], self._row
        )
        """Per sample, an id from where its latents live (:func:`sdforge.captions.mix.sample_ids`)."""
        self.latent_shape: tuple[int, ...] = tuple(self.latent_shapes[0])
        """The first bucket's latent shape (the only one for a square-only phase)."""
        log.info(
            "indexed %d samples in %d bucket(s) %s, %d memory-mapped shard files from %s",
            len(self),
            len(self.buckets),
            self.buckets,
            len(self._shards),
            index_path,
        )

    def _check_rows(self, index_path, latents_dir, resolution, where, arrays: ShardArrays, rows: np.ndarray) -> None:
        bad = rows[(rows < 0) | (rows >= len(arrays))]
        if bad.size:
            source, shard, bucket = where
            raise InputError(
                f"{index_path}: source '{source}' shard {shard} bucket {bucket[0]}x{bucket[1]} "
                f"({shard_path(latents_dir, source, resolution, shard, bucket)}) has {len(arrays)} rows but the "
                f"index points at row(s) {bad[:5].tolist()} ({bad.size} of its {rows.size} rows out of range); "
                f"re-run encode_latents@{source}, then mix_phase"
            )

    def _check_shape(self, index_path, where, arrays: ShardArrays, expected: tuple[int, ...]) -> None:
        first_ids = self._shards[0].input_ids.shape[1:] if self._shards else arrays.input_ids.shape[1:]
        if arrays.latents.shape[1:] != expected or arrays.input_ids.shape[1:] != first_ids:
            source, shard, bucket = where
            raise InputError(
                f"{index_path}: source '{source}' shard {shard} holds latents {arrays.latents.shape[1:]} / ids "
                f"{arrays.input_ids.shape[1:]} for bucket {bucket[0]}x{bucket[1]}, but other shards hold "
                f"{expected} / {first_ids}; one bucket needs one latent shape (re-run encode_latents@{source})"
            )

    def __len__(self) -> int:
        return self._row.shape[0]

    @property
    def row(self) -> np.ndarray:
        return self._row

    def file_rows(self, sid: int) -> int:
        """How many samples shard file ``sid`` (a position in :attr:`shard_keys`) holds."""
        return len(self._shards[sid])

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The shard file (an index into :attr:`shard_keys`) and row of each sample at index ``positions``."""
        positions = np.asarray(positions)
        return self._sid[positions], self._row[positions]

    def gather(self, positions: np.ndarray, synthetic: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latents fp32 [B, C, h, w], input_ids int64 [B, 77])`` of the samples at index ``positions``
        (all of one bucket); where ``synthetic[i]`` (and the sample has one) its synthetic caption's ids."""
        positions = np.asarray(positions)
        use = np.zeros(len(positions), bool) if synthetic is None else np.asarray(synthetic, bool)
        sid, row = self._sid[positions], self._row[positions]
        buckets = np.unique(self.sample_bucket[positions])
        if buckets.size > 1:
            raise ValueError(f"a batch mixes buckets {[self.buckets[b] for b in buckets.tolist()]}")
        first = self._shards[sid[0]] if positions.size else self._shards[0]
        latents = np.empty((len(positions), *first.latents.shape[1:]), dtype=first.latents.dtype)
        input_ids = np.empty((len(positions), *first.input_ids.shape[1:]), dtype=first.input_ids.dtype)
        order = np.lexsort((row, sid))  # shard by shard, rows ascending: sequential-ish reads
        starts = np.flatnonzero(np.diff(sid[order])) + 1
        for group in np.split(order, starts):
            if group.size == 0:
                continue
            shard = self._shards[sid[group[0]]]
            rows = row[group]
            latents[group] = shard.latents[rows]
            input_ids[group] = shard.input_ids[rows]
            if shard.synthetic_ids is not None and use[group].any():
                pick = group[use[group]]
                input_ids[pick] = shard.synthetic_ids[row[pick]]
        return to_float32(latents), torch.from_numpy(input_ids).long()

    def prefetch(self, positions: np.ndarray) -> None:
        """Queue reads of the latents at ``positions`` with the kernel (``MADV_WILLNEED``; no waiting).

        A shard's first prefetch also queues its whole ``input_ids`` block (~1.3 MB per 4096 rows),
        so token rows never cost a read of their own.
        """
        positions = np.asarray(positions)
        for sid, row in zip(self._sid[positions].tolist(), self._row[positions].tolist(), strict=True):
            if sid not in self._ids_fetched:
                self._ids_fetched.add(sid)
                for ids in (self._shards[sid].input_ids, self._shards[sid].synthetic_ids):
                    if ids is not None:
                        _will_need(ids, 0, ids.nbytes)
            latents, size = self._shards[sid].latents, self._row_bytes[sid]
            _will_need(latents, row * size, size)


def to_float32(array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy(array).float()``, converted in chunks too small for torch's intra-op threads.

    One ``.float()`` of a whole batch (393k elements at 24×4×64×64) is split across torch's OpenMP
    threads; on a busy machine the threads wait for each other and the conversion takes ~10× longer.
    Chunks of at most torch's grain size (32768 elements) run on the calling thread. Same values either way.
    """
    out = torch.empty(array.shape, dtype=torch.float32)
    per_sample = max(1, int(np.prod(array.shape[1:])))
    step = max(1, _GRAIN_SIZE // per_sample)
    for i in range(0, array.shape[0], step):
        out[i : i + step].copy_(torch.from_numpy(array[i : i + step]))
    return out


def _advise_random(array: np.ndarray) -> None:
    """``MADV_RANDOM`` on a memmap: a page fault reads that page, not the kernel's read-around window.

    Rows are visited in random order and :meth:`LatentIndexDataset.prefetch` reads exactly each
    row's bytes ahead of use, so read-around (often several MB) would only evict useful pages.
    """
    mapping = getattr(array, "_mmap", None)  # numpy.memmap keeps its mmap.mmap here
    if mapping is not None and hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)


def _will_need(array: np.ndarray, start: int, length: int) -> None:
    """``MADV_WILLNEED`` on bytes ``[start, start + length)`` of a memmap's data: the kernel starts reading them.

    Without numpy's private ``_mmap`` (a future numpy) this is a no-op: reads then happen on first touch.
    """
    mapping = getattr(array, "_mmap", None)
    if mapping is None or not hasattr(mmap, "MADV_WILLNEED"):
        return
    start += array.offset % mmap.ALLOCATIONGRANULARITY  # where numpy.memmap's data begins in its mapping
    aligned = start - start % mmap.PAGESIZE
    mapping.madvise(mmap.MADV_WILLNEED, aligned, start + length - aligned)


class _Index(NamedTuple):
    """A phase index's columns: ``sources[source_code[i]]``, ``shard[i]``, bucket, ``row[i]`` (sources sorted)."""

    sources: list[str]
    source_code: np.ndarray
    shard: np.ndarray
    bucket_width: np.ndarray
    bucket_height: np.ndarray
    row: np.ndarray


_INDEX_COLUMNS = ("source", "shard", "bucket_width", "bucket_height", "row")


def _read_index(index_path: Path) -> _Index:
    """The phase index's three columns, read with pyarrow (the GPU image has it; polars is kept off this path)."""
    remedy = "re-run mix_phase for this phase"
    if not index_path.is_file():
        raise InputError(f"{index_path}: missing ({remedy})")
    try:
        table = pq.read_table(index_path)
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"{index_path}: unreadable parquet ({type(err).__name__}: {err}); {remedy}") from None
    missing = sorted(set(_INDEX_COLUMNS) - set(table.column_names))
    if missing:
        raise InputError(f"{index_path}: lacks column(s) {missing}; {remedy}")
    if table.num_rows == 0:
        raise InputError(f"{index_path}: the phase index is empty")
    nulls = [name for name in _INDEX_COLUMNS if table[name].null_count]
    if nulls:
        raise InputError(f"{index_path}: null values in column(s) {nulls}; {remedy}")
    try:
        source = np.asarray(table["source"].cast(pa.string()).to_pylist(), dtype=object)
        shard, bw, bh, row = (table[c].cast(pa.int64()).to_numpy() for c in _INDEX_COLUMNS[1:])
    except (pa.ArrowException, ValueError) as err:
        raise InputError(f"{index_path}: bad source/shard/bucket/row values ({err}); {remedy}") from None
    bad = [c for c, v in (("shard", shard), ("bucket_width", bw), ("bucket_height", bh)) if v.min() < 0]
    if bad or shard.max() >= 2**40 or max(bw.max(), bh.max()) >= 2**31:
        raise InputError(f"{index_path}: negative or too large values in column(s) {bad or ['shard/bucket']}; {remedy}")
    sources, source_code = np.unique(source, return_inverse=True)
    if len(sources) > 127:
        raise InputError(f"{index_path}: more than 127 sources in one phase index; {remedy}")
    return _Index(sources.tolist(), source_code.reshape(-1), shard, bw, bh, row)


def _open_checked(
    index_path: Path, latents_dir: Path, resolution: str, source: str, shard: int, bucket: tuple[int, int]
) -> ShardArrays:
    path = shard_path(latents_dir, source, resolution, shard, bucket)
    where = f"{index_path}: source '{source}' shard {shard} bucket {bucket[0]}x{bucket[1]}"
    if not path.is_file():
        raise InputError(f"{where}: {path} does not exist (re-run encode_latents@{source}, then mix_phase)")
    try:
        return open_shard(path)
    except InputError as err:
        raise InputError(f"{where}: {err}") from None


def rank_batches(
    sample_bucket: np.ndarray, epoch: int, seed: int, rank: int, split: BatchSplit, tail: str = "drop"
) -> list[np.ndarray]:
    """The sample positions of each of this rank's micro-batches in ``epoch``, step by step: this rank's parts
    (``split``) of :func:`~sdforge.latents.bucket_batches.plan_epoch`'s global batches."""
    plan = plan_epoch(np.asarray(sample_bucket), epoch, seed, split.global_batch, tail)
    return plan.micro_batches(rank, split)


def epochs_summary(
    data: LatentIndexDataset, epochs: int, seed: int, global_batch: int, tail: str = "drop"
) -> tuple[list[int], dict[str, int]]:
    """Optimizer steps (global batches) in each epoch, and per bucket ``W x H`` the samples trained (all ranks,
    all epochs: ``bucket.WxH.samples``) and left out (dropped tails, or the tails a carry leaves at an epoch's
    end: ``bucket.WxH.left_out``)."""
    names = [f"{w}x{h}" for w, h in data.buckets]
    lengths, counts = [], dict.fromkeys([f"bucket.{n}.{k}" for n in names for k in ("samples", "left_out")], 0)
    for plan in plan_epochs(data.sample_bucket, epochs, seed, global_batch, tail):
        lengths.append(len(plan.batches))
        for key, value in plan.counts().items():
            kind, bucket = key.split(".bucket")
            counts[f"bucket.{names[int(bucket)]}.{kind}"] += value
    return lengths, counts


def caption_choice(data: LatentIndexDataset, seed: int, epoch: int, p_synthetic: float) -> np.ndarray:
    """Per sample of the index: it trains with its synthetic caption in ``epoch`` (drawn with ``p_synthetic``
    per (seed, sample, epoch), :func:`sdforge.captions.mix.synthetic_mask`, and only if it has one)."""
    return synthetic_mask(seed, epoch, data.sample_ids, p_synthetic) & data.has_synthetic


def iter_batches(
    data: LatentIndexDataset, batches: list[np.ndarray], start_batch: int = 0, synthetic: np.ndarray | None = None
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield ``(batch_index, latents fp32, input_ids)`` for ``batches`` (:func:`rank_batches`) from
    ``start_batch`` to the end; ``synthetic`` (per sample of the index, :func:`caption_choice`) picks the
    caption each sample trains with.

    Batches before ``start_batch`` are never read. While batch ``b`` is gathered, the reads of the
    next :data:`PREFETCH_BATCHES` batches are already queued with the kernel.
    """
    for b in range(start_batch, min(start_batch + PREFETCH_BATCHES, len(batches))):
        data.prefetch(batches[b])
    for b in range(start_batch, len(batches)):
        if b + PREFETCH_BATCHES < len(batches):
            data.prefetch(batches[b + PREFETCH_BATCHES])
        picks = () if synthetic is None else (synthetic[batches[b]],)
        latents, input_ids = data.gather(batches[b], *picks)
        yield b, latents, input_ids
