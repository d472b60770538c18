"""Training data from a phase index over the latent store: deterministic per-epoch, per-rank batches.

:class:`LatentIndexDataset` memory-maps every shard the index names (:func:`sdforge.latents.store.open_shard`:
a header read each) and checks that every indexed row exists; nothing else is read up front. A batch
is gathered from the memmaps on request, shard by shard with rows in ascending order, then put back
in the batch's order. Shard pages live in the OS page cache, shared by every DDP rank on the node.

Every rank sees a disjoint slice of the epoch's permutation (same length on every rank, so DDP
ranks step together), and iteration can start at any batch offset without touching the skipped
batches (mid-epoch resume).
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

from sdforge.io import InputError
from sdforge.latents.store import ShardArrays, open_shard, shard_path

log = logging.getLogger(__name__)

_GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE: smaller elementwise ops stay on the calling thread
PREFETCH_BATCHES = 4
"""Batches ahead of the current one whose rows :func:`iter_batches` asks the kernel to read in."""


class LatentIndexDataset:
    """The samples a phase index points at, read on demand from memory-mapped latent shards."""

    def __init__(self, index_path: Path, latents_dir: Path):
        index_path, latents_dir = Path(index_path), Path(latents_dir)
        index = _read_index(index_path)
        # one shard id per (source, shard), in (source, shard) order; every row's shard id
        keys, self._sid = np.unique(np.stack([index.source_code, index.shard]), axis=1, return_inverse=True)
        self._sid = self._sid.reshape(-1).astype(np.int32)
        self._row = index.row
        self._shards: list[ShardArrays] = []
        self._ids_fetched: set[int] = set()
        for sid, (code, shard) in enumerate(keys.T.tolist()):
            source = index.sources[code]
            arrays = _open_checked(index_path, latents_dir, source, shard)
            rows = self._row[self._sid == sid]
            bad = rows[(rows < 0) | (rows >= len(arrays))]
            if bad.size:
                raise InputError(
                    f"{index_path}: source '{source}' shard {shard} ({shard_path(latents_dir, source, shard)}) has "
                    f"{len(arrays)} rows but the index points at row(s) {bad[:5].tolist()} "
                    f"({bad.size} of its {rows.size} rows out of range); re-run encode_latents@{source}, then mix_phase"
                )
            if self._shards and (
                arrays.latents.shape[1:] != self._shards[0].latents.shape[1:]
                or arrays.input_ids.shape[1:] != self._shards[0].input_ids.shape[1:]
            ):
                raise InputError(
                    f"{index_path}: source '{source}' shard {shard} holds latents {arrays.latents.shape[1:]} / ids "
                    f"{arrays.input_ids.shape[1:]} but earlier shards hold {self._shards[0].latents.shape[1:]} / "
                    f"{self._shards[0].input_ids.shape[1:]}; one phase needs one latent shape"
                )
            _advise_random(arrays.latents)
            self._shards.append(arrays)
        self.latent_shape: tuple[int, ...] = tuple(self._shards[0].latents.shape[1:])
        self._row_bytes = self._shards[0].latents[0].nbytes
        log.info(
            "indexed %d samples %s in %d memory-mapped shards from %s",
            len(self),
            self.latent_shape,
            len(self._shards),
            index_path,
        )

    def __len__(self) -> int:
        return self._row.shape[0]

    def gather(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(latents fp32 [B, C, h, w], input_ids int64 [B, 77])`` of the samples at index ``positions``."""
        positions = np.asarray(positions)
        sid, row = self._sid[positions], self._row[positions]
        first = self._shards[0]
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
                ids = self._shards[sid].input_ids
                _will_need(ids, 0, ids.nbytes)
            latents = self._shards[sid].latents
            _will_need(latents, row * self._row_bytes, self._row_bytes)


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
    """A phase index's columns: ``sources[source_code[i]]``, ``shard[i]``, ``row[i]`` (sources sorted)."""

    sources: list[str]
    source_code: np.ndarray
    shard: np.ndarray
    row: np.ndarray


def _read_index(index_path: Path) -> _Index:
    """The phase index's three columns, read with pyarrow (the GPU image has it; polars is kept off this path)."""
    remedy = "re-run mix_phase for this phase"
    if not index_path.is_file():
        raise InputError(f"{index_path}: missing ({remedy})")
    try:
        table = pq.read_table(index_path)
    except (OSError, pa.ArrowException) as err:
        raise InputError(f"{index_path}: unreadable parquet ({type(err).__name__}: {err}); {remedy}") from None
    missing = sorted({"source", "shard", "row"} - set(table.column_names))
    if missing:
        raise InputError(f"{index_path}: lacks column(s) {missing}; {remedy}")
    if table.num_rows == 0:
        raise InputError(f"{index_path}: the phase index is empty")
    nulls = [name for name in ("source", "shard", "row") if table[name].null_count]
    if nulls:
        raise InputError(f"{index_path}: null values in column(s) {nulls}; {remedy}")
    try:
        source = np.asarray(table["source"].cast(pa.string()).to_pylist(), dtype=object)
        shard = table["shard"].cast(pa.int64()).to_numpy()
        row = table["row"].cast(pa.int64()).to_numpy()
    except (pa.ArrowException, ValueError) as err:
        raise InputError(f"{index_path}: bad source/shard/row values ({err}); {remedy}") from None
    sources, source_code = np.unique(source, return_inverse=True)
    return _Index(sources.tolist(), source_code.reshape(-1), shard, row)


def _open_checked(index_path: Path, latents_dir: Path, source: str, shard: int) -> ShardArrays:
    path = shard_path(latents_dir, source, shard)
    if not path.is_file():
        raise InputError(
            f"{index_path}: source '{source}' shard {shard}: {path} does not exist (re-run encode_latents@{source})"
        )
    try:
        return open_shard(path)
    except InputError as err:
        raise InputError(f"{index_path}: source '{source}' shard {shard}: {err}") from None


def rank_order(num_samples: int, epoch: int, seed: int, rank: int, world: int) -> np.ndarray:
    """Sample positions this rank visits in ``epoch``: a seeded permutation, strided by rank.

    The permutation is truncated to a multiple of ``world`` so every rank has the same length.
    """
    perm = np.random.default_rng([seed, epoch]).permutation(num_samples)
    usable = (num_samples // world) * world
    return perm[:usable][rank::world]


def batches_per_epoch(num_samples: int, world: int, batch_size: int) -> int:
    """Batches per rank per epoch (the last one may be partial)."""
    return -(-(num_samples // world) // batch_size)


def iter_batches(
    data: LatentIndexDataset, epoch: int, seed: int, rank: int, world: int, batch_size: int, start_batch: int = 0
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield ``(batch_index, latents fp32, input_ids)`` from ``start_batch`` to the epoch's end.

    Batches before ``start_batch`` are never read. While batch ``b`` is gathered, the reads of the
    next :data:`PREFETCH_BATCHES` batches are already queued with the kernel.
    """
    order = rank_order(len(data), epoch, seed, rank, world)
    n_batches = batches_per_epoch(len(data), world, batch_size)
    if start_batch < n_batches:
        data.prefetch(order[start_batch * batch_size : (start_batch + PREFETCH_BATCHES) * batch_size])
    for b in range(start_batch, n_batches):
        ahead = b + PREFETCH_BATCHES
        data.prefetch(order[ahead * batch_size : (ahead + 1) * batch_size])
        latents, input_ids = data.gather(order[b * batch_size : (b + 1) * batch_size])
        yield b, latents, input_ids
