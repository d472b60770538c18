"""VGGFace2: identity folders of face JPEGs, captioned from templates.

Layout (the licence-gated release, unpacked): ``train/n000002/0001_01.jpg`` (``test/`` likewise) and
``meta/identity_meta.csv`` with ``Class_ID, Name, Sample_Num, Flag, Gender`` (a space after each
comma in the real file; ``Gender`` ``m``/``f``). The identity is an image's parent folder. Row:
``archive`` null, ``member`` = the relative path, ``caption`` = a template of ``vggface2.templates``
chosen by a stable hash of the path, ``{gender}`` filled from the CSV (``vggface2.gender_words``,
else ``vggface2.unknown_gender``), ``meta`` = ``{identity, name, gender, template}``.

Drops (:data:`sdforge.ingest.sources.loose.REASONS`): ``unsafe_member`` (symlink leaving the folder),
``duplicate`` (same path with another image suffix), ``unreadable`` / ``too_small`` (header read
only when ``filter.min_width``/``min_height`` is set). Extra metric: ``rows_unknown_gender``.
"""

from __future__ import annotations

import csv
import hashlib
from pathlib import Path

from sdforge.config import FaceOptions, FilterRules
from sdforge.ingest.sources import loose
from sdforge.ingest.sources.rows import DropCounter, row, write_rows
from sdforge.io import InputError

META_FILE = "identity_meta.csv"


def read_identity_meta(path: Path) -> dict[str, dict[str, str]]:
    """``{Class_ID: {"name": ..., "gender": ...}}`` from an ``identity_meta.csv`` (headers and values stripped)."""
    with path.open(newline="", encoding="utf-8", errors="replace") as fh:
        reader = csv.reader(fh, skipinitialspace=True)
        header = [h.strip() for h in next(reader, [])]
        if "Class_ID" not in header or "Gender" not in header:
            raise InputError(f"{path}: expected columns Class_ID, Name, Sample_Num, Flag, Gender; got {header}")
        col = {name: header.index(name) for name in header}
        identities = {}
        for line in reader:
            if len(line) < len(header):
                continue
            values = [v.strip() for v in line]
            identities[values[col["Class_ID"]]] = {
                "name": values[col["Name"]] if "Name" in col else "",
                "gender": values[col["Gender"]],
            }
    return identities


def template_index(member: str, n: int) -> int:
    """A stable choice among ``n`` templates for ``member`` (SHA-256 of the path; no seed, no hash salt)."""
    return int.from_bytes(hashlib.sha256(member.encode()).digest()[:8], "big") % n


def filter_vggface2(
    in_dir: Path,
    out_file: Path,
    options: FaceOptions,
    rules: FilterRules,
    max_pixels: int | None = None,
    max_caption_chars: int | None = None,
) -> dict[str, int]:
    """One row per face image, with a template caption."""
    identities: dict[str, dict[str, str]] = {}
    for meta_path in sorted(in_dir.rglob(META_FILE)):
        identities |= read_identity_meta(meta_path)
    files = loose.scan(in_dir)
    if not files:
        raise InputError(f"no images under {in_dir} (run download_metadata first)")
    drops, rows, unknown = DropCounter(loose.REASONS), [], 0
    for member, _, _ in loose.images(in_dir, rules, drops, files, max_pixels):
        identity = member.rsplit("/", 2)[-2] if "/" in member else ""
        info = identities.get(identity, {})
        gender = info.get("gender")
        word = options.gender_words.get(gender) if gender else None
        if word is None:
            unknown += 1
            word = options.unknown_gender
        index = template_index(member, len(options.templates))
        caption = options.templates[index].format(gender=word)
        meta = {"identity": identity, "name": info.get("name"), "gender": gender, "template": index}
        rows.append(row(None, member, caption, meta))
    cut = write_rows(rows, out_file, max_caption_chars)
    return drops.metrics(
        files=len(files), rows_in=len(files), rows_out=len(rows), rows_unknown_gender=unknown, captions_truncated=cut
    )
