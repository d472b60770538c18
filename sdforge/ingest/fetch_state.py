"""Kill-safe fetching: the fingerprint of what a shard folder was fetched from, and the folder prepared
for a rerun (finished shards kept when the fingerprint matches, else emptied). See ``docs/FETCH.md``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from sdforge.config import FetchSettings
from sdforge.ingest import shards
from sdforge.io import atomic_write_bytes, fresh_folder, require_writable
from sdforge.output_dirs import move_aside

log = logging.getLogger(__name__)

FINGERPRINT_FILE = ".fetch-fingerprint"
"""Inside the output folder, so it travels with the shards (DVC cache, checkout). Not ``*.json``:
img2dataset's incremental mode reads every ``*.json`` of the folder as a shard's stats."""
FINGERPRINT_VERSION = 2
"""Bumped when the same inputs and settings make different shards: 2 (issue 55) decodes URLs with the local
kinds' decode policy (EXIF orientation, HDR refused) and writes every error message on one line."""
OUTPUT_SETTINGS = (
    "image_size",
    "resize_mode",
    "shard_size",
    "encode_quality",
    "allow_networks",
    "max_image_pixels",
    "user_agent_token",
)
"""The fetch settings that change what a finished shard holds (processes, threads, distributor,
timeout, retries and the success-rate warning do not; changing them resumes)."""


def archive_listing(metadata_dir: Path) -> str:
    """SHA-256 of the sorted (relative path, size) of every file under ``metadata_dir``.

    The local kinds read their images from these files; downloads are immutable per name, so a
    name or size change is what marks different inputs (mtimes change on every DVC checkout).
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in metadata_dir.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(metadata_dir).as_posix()}\0{path.stat().st_size}\n".encode())
    return digest.hexdigest()


def served_digest(root: Path) -> str:
    """SHA-256 of the sorted (relative path, bytes) of every file under ``root``: what a loopback server
    (the demo's) hands out. Its URLs stay the same when the images change, so the URL list cannot tell."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(root).as_posix()}\0{path.stat().st_size}\n".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def fingerprint(filtered: Path, fetch: FetchSettings, archives: str | None = None, served: str | None = None) -> str:
    """The fingerprint text of fetching ``filtered`` with ``fetch``: its SHA-256 and :data:`OUTPUT_SETTINGS`
    (plus, for the local kinds, the :func:`archive_listing` of the files the images come from, and with a
    loopback server, the :func:`served_digest` of what it serves)."""
    digest = hashlib.sha256()
    with open(filtered, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    settings = {key: getattr(fetch, key) for key in OUTPUT_SETTINGS}
    settings["allow_networks"] = sorted(settings["allow_networks"])
    doc = {"version": FINGERPRINT_VERSION, "filtered_sha256": digest.hexdigest(), "settings": settings}
    if archives is not None:
        doc["archives_sha256"] = archives
    if served is not None:
        doc["served_sha256"] = served
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def prepare_out_dir(out_dir: Path, fingerprint_text: str) -> bool:
    """Keep ``out_dir``'s finished shards when its fingerprint matches (return True), else empty it; a folder
    with files but no fingerprint (not fetched by this stage) is moved aside instead (:func:`move_aside`).

    Either way ``out_dir`` then holds the fingerprint and only finished shards. A folder that cannot be written
    (read-only, forbidden, full) is an :class:`~sdforge.io.OutputError` before anything in it is touched.
    """
    require_writable(out_dir, "the fetched shards", setting="paths.shards")
    path = out_dir / FINGERPRINT_FILE
    if path.is_file() and path.read_text() == fingerprint_text:
        removed = shards.discard_unfinished(out_dir, keep={FINGERPRINT_FILE})
        log.info(
            "resuming the fetch in %s: %d finished shards kept, removed %s",
            out_dir,
            len(shards.finished_shards(out_dir)),
            removed or "nothing",
        )
        return True
    if path.is_file():
        log.info("%s was fetched from other inputs or settings: emptying it", out_dir)
    elif out_dir.is_dir() and any(out_dir.iterdir()):  # no fingerprint: not fetched by this stage
        move_aside(out_dir, "holds files this stage did not fetch (no .fetch-fingerprint)")
    fresh_folder(out_dir, "the fetched shards", setting="paths.shards")  # its own earlier fetch, or nothing
    atomic_write_bytes(path, fingerprint_text.encode())
    return False
