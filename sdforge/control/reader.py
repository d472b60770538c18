"""The conditioning image of each training sample, read beside its latent: what a ControlNet phase trains on
(docs/CONTROL.md).

A phase's samples are rows of latent shard files (:class:`sdforge.latents.loader.LatentIndexDataset`); each has a
condition file of the same name under ``<conditions>/<source>/<resolution>/<kind>/`` whose row ``r`` is the edge
map of latent row ``r`` (``condition_images``). Every file is checked when the reader opens: its shard marker must
name the latent part the latents came from (the same sha256), so a condition is never paired with another latent.
Rows are memory-mapped and unpacked per batch.

A sample ``condition_images`` skipped (its ``valid`` flag is 0: missing from its tar, undecodable, cropped
differently) trains under an empty map; the reader counts those samples (``missing``) and the phase's metrics
report them, and the first few are named in the log.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch

from sdforge.config import Params
from sdforge.io import InputError
from sdforge.latents import store
from sdforge.latents.loader import LatentIndexDataset

log = logging.getLogger(__name__)

NAMED_MISSING = 10
"""How many samples without a condition the log names (all are counted)."""


class ConditionFile:
    """One condition file's packed maps and validity flags, memory-mapped."""

    def __init__(self, path: Path, kind: str, bucket: tuple[int, int]):
        header, start = store.read_header(path)
        self.width, self.height = bucket
        self.maps = _mapped(path, header, start, kind)
        self.valid = _mapped(path, header, start, "valid")
        if self.maps.shape[1] != (self.width * self.height + 7) // 8 or len(self.valid) != len(self.maps):
            raise InputError(f"{path}: its maps {self.maps.shape} do not fit bucket {self.width}x{self.height}; "
                             "delete it and re-run condition_images")  # fmt: skip


class ConditionReader:
    """The ``kind`` conditioning images of the samples of ``data`` (one phase's index), from ``conditions_dir``."""

    def __init__(self, data: LatentIndexDataset, conditions_dir: Path, latents_dir: Path, resolution: str, kind: str):
        self.data, self.kind = data, kind
        self.files = [
            _open_checked(Path(conditions_dir), Path(latents_dir), resolution, kind, *where)
            for where in data.shard_keys
        ]
        self.missing = 0
        """Samples read so far that have no condition (trained under an empty map)."""

    def gather(self, positions: np.ndarray) -> torch.Tensor:
        """The conditioning images of the samples at index ``positions`` (one bucket): ``float32 [B, 3, H, W]``,
        each channel the edge map in {0, 1} (an empty map for a sample without one, counted in :attr:`missing`)."""
        sids, rows = self.data.locate(positions)
        first = self.files[int(sids[0])]
        out = np.zeros((len(sids), first.height * first.width), dtype=np.uint8)
        for i, (sid, row) in enumerate(zip(sids.tolist(), rows.tolist(), strict=True)):
            file = self.files[sid]
            if file.valid[row]:
                out[i] = np.unpackbits(file.maps[row], count=file.height * file.width)
            else:
                self._note_missing(sid, row)
        maps = torch.from_numpy(out).reshape(len(sids), 1, first.height, first.width).float()
        return maps.expand(-1, 3, -1, -1).contiguous()

    def _note_missing(self, sid: int, row: int) -> None:
        self.missing += 1
        if self.missing <= NAMED_MISSING:
            source, shard, bucket = self.data.shard_keys[sid]
            log.warning("%s shard %05d bucket %dx%d row %d has no %s condition (condition_images skipped it: its "
                        "shard marker says why); it trains under an empty map", source, shard, *bucket, row,
                        self.kind)  # fmt: skip


def _mapped(path: Path, header: dict, start: int, name: str) -> np.ndarray:
    info = header.get(name)
    if info is None or info.get("dtype") != "U8":
        raise InputError(f"{path}: no uint8 tensor {name!r}; delete it and re-run condition_images")
    begin, end = info["data_offsets"]
    shape = tuple(info["shape"])
    if start + end > path.stat().st_size or end - begin != int(np.prod(shape)):
        raise InputError(f"{path}: tensor {name!r} is truncated; delete it and re-run condition_images")
    return np.memmap(str(path), dtype=np.uint8, mode="r", offset=start + begin, shape=shape)


def _open_checked(conditions: Path, latents: Path, resolution: str, kind: str, source: str, shard: int,
                  bucket: tuple[int, int]) -> ConditionFile:  # fmt: skip
    """The condition file of one latent shard file, after checking its marker names the latents' own part."""
    folder = conditions / source / resolution / kind
    path = folder / store.shard_name(shard, bucket)
    marker_path = folder / f"shard-{shard:05d}.json"
    if not path.is_file() or not marker_path.is_file():
        raise InputError(f"{path}: no {kind} conditions for latent shard {shard:05d} of '{source}' (or its shard "
                         f"is unfinished); run condition_images@{source} with {kind} in conditions.kinds")  # fmt: skip
    part = latents / source / resolution / store.part_name(shard)
    made_from = json.loads(marker_path.read_text()).get("latent_part")
    if not part.is_file() or made_from != hashlib.sha256(part.read_bytes()).hexdigest():
        raise InputError(f"{marker_path}: made from other latents than {part} holds now (re-encoded since); re-run "
                         f"condition_images@{source}")  # fmt: skip
    return ConditionFile(path, kind, bucket)


def condition_reader(params: Params, phase_name: str, data: LatentIndexDataset) -> ConditionReader | None:
    """The conditioning images of a ControlNet phase's samples (``phases.<p>.controlnet.condition``), else None."""
    spec = params.phases[phase_name].controlnet
    if spec is None:
        return None
    paths = params.paths
    return ConditionReader(data, Path(paths.conditions), Path(paths.latents), params.phase_resolution(phase_name),
                           spec.condition)  # fmt: skip
