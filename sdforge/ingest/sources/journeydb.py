"""JourneyDB (``JourneyDB/JourneyDB``): tar.gz archives of Midjourney JPEGs + an annotation JSONL.

Layout: ``data/train/imgs/NNN.tgz`` holding ``NNN/<hash>.jpg``, and
``data/train/train_anno_realease_repath.jsonl.tgz`` holding one ``.jsonl`` whose lines are
``{"img_path": "./NNN/<hash>.jpg", "prompt": ..., "Task2": {"Caption": ...}, ...}``. A plain
``*.jsonl`` is read as well. An ``img_path`` folder ``NNN`` names the archive ``NNN.tgz`` (any
folder under the source; ``.tar.gz``/``.tar`` too). Row: ``archive`` = that archive, ``member`` =
``NNN/<hash>.jpg``, ``caption`` = ``prompt`` or ``Task2.Caption`` (``journeydb.caption``),
``meta`` = ``{prompt, task2_caption}``.

Drops, in this order: ``bad_record`` (not a JSON object, no string ``img_path``), ``json_too_deep`` /
``json_too_large`` / ``json_too_many_entries`` (a line over ``sources.<s>.inputs``), ``unsafe_member``
(absolute or ``..`` path), ``missing`` (its archive was not downloaded), ``no_caption`` (the chosen
text is null/missing/not a string), ``duplicate`` (``img_path`` repeated; first kept). Image sizes
are unknown here: ``filter.min_width``/``min_height`` are applied when re-sharding.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

from sdforge.bounds import json_docs
from sdforge.bounds.archives import ArchiveLimitError, bounded_lines, open_inflated
from sdforge.config import FilterRules, InputLimits, JourneyDbOptions
from sdforge.ingest.sources.rows import DropCounter, row, safe_member, write_rows
from sdforge.io import InputError

REASONS = ("bad_record", *json_docs.REASONS, "unsafe_member", "missing", "no_caption", "duplicate")
ARCHIVE_SUFFIXES = (".tgz", ".tar.gz", ".tar")
ANNOTATION_SUFFIXES = (".jsonl", ".jsonl.tgz", ".jsonl.tar.gz", ".jsonl.tar")


def _strip(name: str, suffixes: tuple[str, ...]) -> str | None:
    for suffix in sorted(suffixes, key=len, reverse=True):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return None


def find_files(in_dir: Path) -> tuple[list[Path], dict[str, str]]:
    """Annotation files (sorted) and image archives by stem (``{"000": "data/train/imgs/000.tgz"}``)."""
    annotations, archives = [], {}
    for path in sorted(p for p in in_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(in_dir).as_posix()
        if _strip(path.name, ANNOTATION_SUFFIXES) is not None:
            annotations.append(path)
        elif (stem := _strip(path.name, ARCHIVE_SUFFIXES)) is not None:
            if stem in archives:
                raise InputError(f"{in_dir}: two image archives named {stem!r}: {archives[stem]} and {rel}")
            archives[stem] = rel
    if not annotations:
        raise InputError(f"no annotation *.jsonl / *.jsonl.tgz under {in_dir} (run download_metadata first)")
    return annotations, archives


def annotation_lines(path: Path, limits: InputLimits = json_docs.DEFAULT_LIMITS) -> Iterator[bytes | None]:
    """The non-blank lines of a ``.jsonl``, or of every regular ``.jsonl`` member of a (gzipped) tar; None for a
    line over ``json_max_bytes`` (skipped without holding it). A (gzipped) tar inflating past
    ``archive_max_ratio`` × its size or ``archive_max_bytes`` is an :class:`InputError` naming it and the keys."""
    if path.name.endswith(".jsonl"):
        with path.open("rb") as fh:
            yield from bounded_lines(fh, limits.json_max_bytes)
        return
    try:
        with open_inflated(path, limits) as inflated, tarfile.open(fileobj=inflated, mode="r|") as tar:
            for info in tar:
                if info.isreg() and info.name.endswith(".jsonl"):
                    fh = tar.extractfile(info)
                    assert fh is not None
                    yield from bounded_lines(fh, limits.json_max_bytes)
    except ArchiveLimitError as err:
        raise InputError(f"annotation archive {err}") from None
    except (tarfile.TarError, EOFError, OSError) as err:
        raise InputError(f"{path}: unreadable annotation archive ({type(err).__name__}: {err})") from None


def parse_record(line: bytes, limits: InputLimits = json_docs.DEFAULT_LIMITS) -> tuple[dict | None, str]:
    """``(record, "")`` for an annotation line with an ``img_path``; else ``(None, reason)``: ``bad_record``,
    or the limit of ``sources.<s>.inputs`` the line breaks (:data:`sdforge.bounds.json_docs.REASONS`)."""
    try:
        record = json_docs.loads(line, limits)
    except json_docs.JsonLimitError as err:
        return None, err.reason
    except ValueError:  # not JSON, not UTF-8
        return None, "bad_record"
    ok = isinstance(record, dict) and isinstance(record.get("img_path"), str)
    return (record, "") if ok else (None, "bad_record")


def filter_journeydb(
    in_dir: Path,
    out_file: Path,
    options: JourneyDbOptions,
    rules: FilterRules,
    limits: InputLimits = json_docs.DEFAULT_LIMITS,
    max_caption_chars: int | None = None,
) -> dict[str, int]:
    """One row per annotation line whose image archive is present, with the chosen caption."""
    annotations, archives = find_files(in_dir)
    drops, rows, kept, rows_in = DropCounter(REASONS), [], set(), 0
    for path in annotations:
        for line in annotation_lines(path, limits):
            rows_in += 1
            record, reason = parse_record(line, limits) if line is not None else (None, json_docs.TOO_LARGE)
            if record is None:
                drops.drop(reason)
                continue
            member = safe_member(record["img_path"])
            if member is None:
                drops.drop("unsafe_member")
                continue
            folder = member.split("/", 1)[0] if "/" in member else None
            task2 = record.get("Task2") if isinstance(record.get("Task2"), dict) else {}
            prompt, description = record.get("prompt"), task2.get("Caption")
            caption = prompt if options.caption == "prompt" else description
            if folder not in archives:
                drops.drop("missing")
            elif not isinstance(caption, str):
                drops.drop("no_caption")
            elif member in kept:
                drops.drop("duplicate")
            else:
                kept.add(member)
                meta = {"prompt": prompt, "task2_caption": description}
                rows.append(row(archives[folder], member, caption, meta))
    cut = write_rows(rows, out_file, max_caption_chars, min_width=rules.min_width, min_height=rules.min_height)
    return drops.metrics(
        files=len(annotations) + len(archives), rows_in=rows_in, rows_out=len(rows), captions_truncated=cut
    )
