"""The latent store's on-disk format: one safetensors file per shard, memory-mapped for reading.

``${paths.latents}/<source>/<resolution>/`` (one folder per bucket set, :class:`sdforge.config.BucketSet`)::

    shard-NNNNN-WxH.safetensors  input tar NNNNN's samples of bucket W×H (pixels): latents fp16
                                 [N, C, H/f, W/f] (posterior mean × scaling factor), input_ids int32 [N, 77]
                                 and, for a recaptioned source, synthetic_ids int32 [N, 77] (the samples'
                                 synthetic captions, caption_images; the original where there is none)
    shard-NNNNN.parquet          that tar's manifest rows (every bucket); its parquet metadata equals
                                 each bucket file's ``__metadata__`` (written after them: a shard is
                                 complete when all exist and agree, see :func:`check_shard`)
    manifest.parquet             one row per sample: key, caption, source, shard, bucket_width,
                                 bucket_height, row (in its bucket's file), crop box, ... (the parts
                                 concatenated, written last)

Shards are plain safetensors (any tool opens them). For reading, :func:`open_shard` parses the
safetensors header itself and returns ``numpy.memmap`` views of the tensors, so opening a shard
costs a header read and a random row costs one page-cache lookup; nothing is loaded up front.
"""

from __future__ import annotations

import io
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdforge.io import InputError, atomic_write_bytes

if TYPE_CHECKING:  # torch (~2 s) only where shards are written: mix_phase and the loader only read
    import torch

MANIFEST = "manifest.parquet"
SHARD_PATTERN = "shard-*.safetensors"
_DTYPES = {"F16": np.float16, "F32": np.float32, "I32": np.int32, "I64": np.int64, "BF16": None}


def shard_name(shard: int, bucket: tuple[int, int]) -> str:
    """File name of input tar ``shard``'s latents of ``bucket`` = (width, height) in pixels."""
    return f"shard-{shard:05d}-{bucket[0]}x{bucket[1]}.safetensors"


def shard_number(name: str) -> int | None:
    """The input tar number in a store file name (``shard-NNNNN-WxH.safetensors``, ``shard-NNNNN.parquet``)."""
    number = name.split(".")[0].removeprefix("shard-").split("-")[0]
    return int(number) if number.isdigit() else None


def resolution_dir(latents_dir: Path, source: str, resolution: str) -> Path:
    """The folder of ``source``'s latents at bucket set ``resolution`` under the store root ``latents_dir``."""
    return Path(latents_dir) / source / resolution


def shard_path(latents_dir: Path, source: str, resolution: str, shard: int, bucket: tuple[int, int]) -> Path:
    """Path of ``source``'s latents of input tar ``shard`` and ``bucket`` at ``resolution``."""
    return resolution_dir(latents_dir, source, resolution) / shard_name(shard, bucket)


def part_buckets(table: pa.Table) -> dict[tuple[int, int], int]:
    """Bucket (width, height) → its row count in a manifest part, sorted by bucket."""
    if table.num_rows == 0:
        return {}
    pairs = zip(table.column("bucket_width").to_pylist(), table.column("bucket_height").to_pylist(), strict=True)
    counts: dict[tuple[int, int], int] = {}
    for pair in pairs:
        counts[pair] = counts.get(pair, 0) + 1
    return dict(sorted(counts.items()))


def write_shard(path: Path, latents: torch.Tensor, input_ids: torch.Tensor, metadata: dict[str, str] | None = None):
    """Write one shard atomically (temp name, then rename): latents as fp16, token ids as int32."""
    if latents.shape[0] != input_ids.shape[0]:
        raise ValueError(f"{path}: {latents.shape[0]} latents but {input_ids.shape[0]} token rows")
    atomic_write_bytes(path, _safetensors(latents, input_ids, metadata))


SYNTHETIC = "synthetic_ids"
"""The optional tensor of a recaptioned source's shards: token ids of each sample's synthetic caption."""


@dataclass(frozen=True)
class ShardArrays:
    """Read-only memory-mapped views of one shard's tensors; ``synthetic_ids`` only for a recaptioned source."""

    latents: np.ndarray
    input_ids: np.ndarray
    metadata: dict[str, str]
    synthetic_ids: np.ndarray | None = None

    def __len__(self) -> int:
        return self.latents.shape[0]


def read_header(path: Path) -> tuple[dict, int]:
    """The safetensors JSON header of ``path`` and the byte offset where tensor data starts."""
    try:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            if size > 100_000_000:
                raise ValueError(f"header size {size} is implausible")
            header = json.loads(fh.read(size))
    except (OSError, struct.error, ValueError) as err:
        raise InputError(f"{path}: unreadable safetensors shard ({err}); delete it, re-run encode_latents") from None
    return header, 8 + size


def open_shard(path: Path) -> ShardArrays:
    """Memory-map a shard's ``latents`` and ``input_ids``; raise :class:`InputError` if it is damaged."""
    path = Path(path)
    header, data_start = read_header(path)
    file_size = path.stat().st_size
    arrays = {}
    for name in ("latents", "input_ids", SYNTHETIC):
        info = header.get(name)
        if info is None and name == SYNTHETIC:
            continue
        if info is None or _DTYPES.get(info["dtype"]) is None:
            raise InputError(f"{path}: tensor {name!r} missing or of an unreadable dtype; re-run encode_latents")
        start, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        shape = tuple(info["shape"])
        if data_start + end > file_size or end - start != dtype.itemsize * int(np.prod(shape)):
            raise InputError(f"{path}: tensor {name!r} is truncated; delete the shard and re-run encode_latents")
        # a str, not a Path: numpy.memmap resolve()s a Path (~0.4 ms of syscalls per file at 200 files)
        arrays[name] = np.memmap(str(path), dtype=dtype, mode="r", offset=data_start + start, shape=shape)
    if any(a.shape[0] != arrays["latents"].shape[0] for a in arrays.values()):
        raise InputError(f"{path}: latents and token ids disagree on the row count; re-run encode_latents")
    meta = header.get("__metadata__") or {}
    return ShardArrays(arrays["latents"], arrays["input_ids"], meta, arrays.get(SYNTHETIC))


def _safetensors(
    latents: torch.Tensor, input_ids: torch.Tensor, metadata: dict[str, str] | None, synthetic_ids=None
) -> bytes:
    """safetensors bytes of a shard: latents as fp16, token ids (and synthetic captions' ids) as int32."""
    import torch  # lazy (~2 s): readers of the store (mix_phase, the loader) never write a shard
    from safetensors.torch import save  # lazy: imports torch

    tensors = {
        "latents": latents.to(torch.float16).contiguous(),
        "input_ids": input_ids.to(torch.int32).contiguous(),
    }
    if synthetic_ids is not None:
        if synthetic_ids.shape != input_ids.shape:
            raise ValueError(f"synthetic_ids {tuple(synthetic_ids.shape)} but input_ids {tuple(input_ids.shape)}")
        tensors[SYNTHETIC] = synthetic_ids.to(torch.int32).contiguous()
    return save(tensors, metadata=metadata)


def shard_bytes(latents: torch.Tensor, input_ids: torch.Tensor, metadata: dict[str, str], synthetic_ids=None) -> bytes:
    """A shard's safetensors bytes with ``__metadata__`` in sorted key order: same input, same bytes
    (:func:`sorted_header`)."""
    if latents.shape[0] != input_ids.shape[0]:
        raise ValueError(f"{latents.shape[0]} latents but {input_ids.shape[0]} token rows")
    return sorted_header(_safetensors(latents, input_ids, metadata, synthetic_ids))


def sorted_header(raw: bytes) -> bytes:
    """safetensors bytes with the ``__metadata__`` map in sorted key order.

    ``safetensors.torch.save`` writes the metadata map in hash order, which changes from process to
    process (DVC would see a new output each run); the header is re-serialised here, the tensor
    data (offsets are relative to the end of the header) is kept as is.
    """
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    if "__metadata__" in header:
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + size :]


def write_shard_sorted(
    path: Path, latents: torch.Tensor, input_ids: torch.Tensor, metadata: dict[str, str], synthetic_ids=None
) -> None:
    """:func:`write_shard` with deterministic bytes (:func:`shard_bytes`), atomically; ``synthetic_ids``: the
    token ids of the samples' synthetic captions (a recaptioned source)."""
    atomic_write_bytes(path, shard_bytes(latents, input_ids, metadata, synthetic_ids))


# --------------------------------------------------------------------- per-shard manifest parts

PART_PATTERN = "shard-*.parquet"


def part_name(shard: int) -> str:
    """File name of shard ``shard``'s manifest part (its rows of ``manifest.parquet``)."""
    return f"shard-{shard:05d}.parquet"


def write_part(path: Path, table: pa.Table, metadata: dict[str, str]) -> None:
    """Write a shard's manifest part atomically, ``metadata`` in the parquet key-value metadata."""
    table = table.replace_schema_metadata({k.encode(): v.encode() for k, v in metadata.items()})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    atomic_write_bytes(path, buf.getvalue())


def read_part(path: Path) -> tuple[pa.Table, dict[str, str]]:
    """A manifest part's rows (schema metadata stripped) and its key-value metadata."""
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid) as err:
        raise InputError(f"{path}: unreadable manifest part ({err})") from None
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items() if k != b"ARROW:schema"}
    return table.replace_schema_metadata(None), meta


def check_shard(directory: Path, shard: int) -> tuple[pa.Table, dict[str, str]]:
    """Verify that shard ``shard`` under ``directory`` is complete; return its part's rows and metadata.

    Complete means: the part ``shard-NNNNN.parquet`` exists, its ``samples`` metadata equals its row
    count, its ``shard`` column is ``shard`` and each bucket's ``row`` values are ``0..n_b-1`` in order;
    exactly the part's buckets have a safetensors file, each opens (not truncated) with ``n_b`` latent
    and token rows of that bucket's shape and carries the same metadata as the part (all written by one
    run). Raises :class:`InputError` naming the first disagreement.
    """
    directory = Path(directory)
    part = directory / part_name(shard)
    if not part.is_file():
        raise InputError(f"{part}: manifest part missing")
    table, meta = read_part(part)
    n = table.num_rows
    if meta.get("samples") != str(n):
        raise InputError(f"{part}: {n} rows but its metadata says samples={meta.get('samples')!r}")
    if n and table.column("shard").to_pylist() != [shard] * n:
        raise InputError(f"{part}: shard column is not {shard}")
    buckets = part_buckets(table)
    _check_rows(part, table, buckets)
    files = {p.name for p in directory.glob(f"shard-{shard:05d}-*.safetensors")}
    extra = sorted(files - {shard_name(shard, b) for b in buckets})
    if extra:
        raise InputError(f"{directory / extra[0]}: exists but its manifest part has no rows of that bucket")
    for bucket, count in buckets.items():
        _check_bucket_file(directory / shard_name(shard, bucket), part.name, bucket, count, meta)
    return table, meta


def _check_rows(part: Path, table: pa.Table, buckets: dict[tuple[int, int], int]) -> None:
    """Each bucket's ``row`` values in ``table`` are ``0..n_b-1`` in order."""
    if not buckets:
        return
    keys = np.array(table.column("bucket_width").to_pylist()) * 1_000_000 + np.array(
        table.column("bucket_height").to_pylist()
    )
    rows = np.array(table.column("row").to_pylist())
    for bucket in buckets:
        got = rows[keys == bucket[0] * 1_000_000 + bucket[1]]
        if not np.array_equal(got, np.arange(got.size)):
            raise InputError(f"{part}: the rows of bucket {bucket[0]}x{bucket[1]} are not 0..{got.size - 1}")


def _check_bucket_file(sf: Path, part_name_: str, bucket: tuple[int, int], count: int, meta: dict[str, str]) -> None:
    """One bucket file of a shard: present, ``count`` rows, the part's metadata."""
    if not sf.is_file():
        raise InputError(f"{sf}: missing (its manifest part has {count} rows of bucket {bucket[0]}x{bucket[1]})")
    arrays = open_shard(sf)
    if len(arrays) != count:
        raise InputError(f"{sf}: {len(arrays)} rows but its manifest part has {count}")
    differ = sorted(k for k in set(meta) | set(arrays.metadata) if meta.get(k) != arrays.metadata.get(k))
    if differ:
        raise InputError(f"{sf}: metadata disagrees with {part_name_} on {differ}")
