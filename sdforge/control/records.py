"""Which conditions a ControlNet phase trains on, as a record DVC can hash: ``mix_phase`` writes
``<phase>.conditions.json`` (the condition kind and the sha256 of each ``condition_images`` shard marker its samples
read) and the phase's train stage depends on it, so new conditions retrain that phase and no other (docs/CONTROL.md).
No torch: ``mix_phase`` imports it."""

from __future__ import annotations

import hashlib
from pathlib import Path

from sdforge.io import InputError, conditions_path, write_json


def marker_digests(shards: set[tuple[str, int]], conditions_dir: Path, resolution: str, kind: str) -> dict[str, str]:
    """The sha256 of the ``kind`` shard marker of each ``(source, shard)``, by its path under ``conditions_dir``
    (they change whenever the conditions do: latent part, settings, OpenCV); an InputError naming a missing one."""
    out = {}
    for source, shard in sorted(shards):
        relative = f"{source}/{resolution}/{kind}/shard-{shard:05d}.json"
        marker = Path(conditions_dir) / relative
        if not marker.is_file():
            raise InputError(f"{marker}: no {kind} conditions for latent shard {shard:05d} of '{source}' (or its "
                             f"shard is unfinished); run condition_images@{source} with {kind} in "
                             "conditions.kinds")  # fmt: skip
        out[relative] = hashlib.sha256(marker.read_bytes()).hexdigest()
    return out


def conditions_record(kind: str | None, shards: set[tuple[str, int]], conditions_dir: Path | None,
                      resolution: str) -> dict:  # fmt: skip
    """``{"kind", "markers"}`` of a phase whose samples come from ``shards``: its condition kind (None: not a
    ControlNet phase, no markers) and :func:`marker_digests`."""
    if kind is None:
        return {"kind": None, "markers": {}}
    if conditions_dir is None:
        raise ValueError("a ControlNet phase's mix needs the conditions folder (paths.conditions)")
    return {"kind": kind, "markers": marker_digests(shards, Path(conditions_dir), resolution, kind)}


def write_conditions_record(index_path: Path, kind: str | None, shards: set[tuple[str, int]],
                            conditions_dir: Path | None, resolution: str) -> None:  # fmt: skip
    """:func:`conditions_record` beside the phase index ``index_path`` (``<phase>.conditions.json``)."""
    write_json(conditions_path(index_path), conditions_record(kind, shards, conditions_dir, resolution))
