"""The latent store's on-disk format: one safetensors file per shard, memory-mapped for reading.

``${paths.latents}/<source>/``::

    shard-NNNNN.safetensors   latents fp16 [N, C, h, w] (posterior mean × scaling factor),
                              input_ids int32 [N, 77]
    shard-NNNNN.parquet       that shard's manifest rows; its parquet metadata equals the
                              safetensors ``__metadata__`` (written after it: a shard is complete
                              when both exist and agree, see :func:`check_shard`)
    manifest.parquet          one row per sample: key, caption, source, shard, row, ...
                              (the parts concatenated, written last)

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


def shard_name(shard: int) -> str:
    """File name of latent shard number ``shard``."""
    return f"shard-{shard:05d}.safetensors"


def shard_path(latents_dir: Path, source: str, shard: int) -> Path:
    """Path of ``source``'s latent shard ``shard`` under the store root ``latents_dir``."""
    return Path(latents_dir) / source / shard_name(shard)


def write_shard(path: Path, latents: torch.Tensor, input_ids: torch.Tensor, metadata: dict[str, str] | None = None):
    """Write one shard atomically (temp name, then rename): latents as fp16, token ids as int32."""
    if latents.shape[0] != input_ids.shape[0]:
        raise ValueError(f"{path}: {latents.shape[0]} latents but {input_ids.shape[0]} token rows")
    atomic_write_bytes(path, _safetensors(latents, input_ids, metadata))


@dataclass(frozen=True)
class ShardArrays:
    """Read-only memory-mapped views of one shard's tensors."""

    latents: np.ndarray
    input_ids: np.ndarray
    metadata: dict[str, str]

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
    for name in ("latents", "input_ids"):
        info = header.get(name)
        if info is None or _DTYPES.get(info["dtype"]) is None:
            raise InputError(f"{path}: tensor {name!r} missing or of an unreadable dtype; re-run encode_latents")
        start, end = info["data_offsets"]
        dtype = np.dtype(_DTYPES[info["dtype"]])
        shape = tuple(info["shape"])
        if data_start + end > file_size or end - start != dtype.itemsize * int(np.prod(shape)):
            raise InputError(f"{path}: tensor {name!r} is truncated; delete the shard and re-run encode_latents")
        arrays[name] = np.memmap(path, dtype=dtype, mode="r", offset=data_start + start, shape=shape)
    if arrays["latents"].shape[0] != arrays["input_ids"].shape[0]:
        raise InputError(f"{path}: latents and input_ids disagree on the row count; re-run encode_latents")
    return ShardArrays(arrays["latents"], arrays["input_ids"], header.get("__metadata__") or {})


def _safetensors(latents: torch.Tensor, input_ids: torch.Tensor, metadata: dict[str, str] | None) -> bytes:
    """safetensors bytes of a shard: latents as fp16, token ids as int32."""
    import torch  # lazy (~2 s): readers of the store (mix_phase, the loader) never write a shard
    from safetensors.torch import save  # lazy: imports torch

    tensors = {
        "latents": latents.to(torch.float16).contiguous(),
        "input_ids": input_ids.to(torch.int32).contiguous(),
    }
    return save(tensors, metadata=metadata)


def shard_bytes(latents: torch.Tensor, input_ids: torch.Tensor, metadata: dict[str, str]) -> bytes:
    """A shard's safetensors bytes with ``__metadata__`` in sorted key order: same input, same bytes.

    ``safetensors.torch.save`` writes the metadata map in hash order, which changes from process to
    process (DVC would see a new output each run); the header is re-serialised here, the tensor
    data (offsets are relative to the end of the header) is kept as is.
    """
    if latents.shape[0] != input_ids.shape[0]:
        raise ValueError(f"{latents.shape[0]} latents but {input_ids.shape[0]} token rows")
    raw = _safetensors(latents, input_ids, metadata)
    (size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + size])
    header["__metadata__"] = dict(sorted(metadata.items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + size :]


def write_shard_sorted(path: Path, latents: torch.Tensor, input_ids: torch.Tensor, metadata: dict[str, str]) -> None:
    """:func:`write_shard` with deterministic bytes (:func:`shard_bytes`), atomically."""
    atomic_write_bytes(path, shard_bytes(latents, input_ids, metadata))


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
    count, its ``shard``/``row`` columns are ``shard`` and ``0..n-1``; the safetensors file opens
    (not truncated) with ``n`` latent and token rows and carries the same metadata as the part (both
    written by one run). A part with ``samples == 0`` has no safetensors file. Raises
    :class:`InputError` naming the first disagreement.
    """
    directory = Path(directory)
    part, sf = directory / part_name(shard), directory / shard_name(shard)
    if not part.is_file():
        raise InputError(f"{part}: manifest part missing")
    table, meta = read_part(part)
    n = table.num_rows
    if meta.get("samples") != str(n):
        raise InputError(f"{part}: {n} rows but its metadata says samples={meta.get('samples')!r}")
    if n and (table.column("shard").to_pylist() != [shard] * n or table.column("row").to_pylist() != list(range(n))):
        raise InputError(f"{part}: shard/row columns are not {shard} and 0..{n - 1}")
    if n == 0:
        if sf.exists():
            raise InputError(f"{sf}: exists but its manifest part has no rows")
        return table, meta
    if not sf.is_file():
        raise InputError(f"{sf}: missing (its manifest part has {n} rows)")
    arrays = open_shard(sf)
    if len(arrays) != n:
        raise InputError(f"{sf}: {len(arrays)} rows but its manifest part has {n}")
    differ = sorted(k for k in set(meta) | set(arrays.metadata) if meta.get(k) != arrays.metadata.get(k))
    if differ:
        raise InputError(f"{sf}: metadata disagrees with {part.name} on {differ}")
    return table, meta
