"""The latent store's on-disk format: one safetensors file per shard, memory-mapped for reading.

``${paths.latents}/<source>/``::

    shard-NNNNN.safetensors   latents fp16 [N, C, h, w] (posterior mean × scaling factor),
                              input_ids int32 [N, 77]
    manifest.parquet          one row per sample: key, caption, source, shard, row, ...

Shards are plain safetensors (any tool opens them). For reading, :func:`open_shard` parses the
safetensors header itself and returns ``numpy.memmap`` views of the tensors, so opening a shard
costs a header read and a random row costs one page-cache lookup; nothing is loaded up front.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save as safetensors_save

from stages.common import InputError, atomic_write_bytes

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
    tensors = {
        "latents": latents.to(torch.float16).contiguous(),
        "input_ids": input_ids.to(torch.int32).contiguous(),
    }
    atomic_write_bytes(path, safetensors_save(tensors, metadata=metadata))


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
