"""Raw metadata into ``paths.metadata/<source>/``: matching files copied from a local folder (never following a
symlink out of it) or downloaded from a hub dataset repo into the hub cache and copied out.
Used by the ``download_metadata`` stage (its docstring says what is kept and why).
"""

from __future__ import annotations

import fnmatch
import logging
import os
import shutil
from pathlib import Path

from sdforge.bounds.paths import resolves_inside, resolves_to_file
from sdforge.config import Source
from sdforge.io import InputError

log = logging.getLogger(__name__)


def is_local(repo: str) -> bool:
    """A local path rather than a hub id (``owner/name``): it exists, is absolute/relative-marked,
    or has other than exactly one ``/``."""
    return Path(repo).exists() or repo.startswith(("/", ".", "~")) or repo.count("/") != 1


def _inside(path: Path, root: Path) -> bool:
    """``path`` (resolved) is ``root`` (resolved) or below it; False for a symlink loop."""
    return resolves_inside(path, root)


def matching_files(root: Path, patterns: list[str], links_within: Path | None = None) -> tuple[list[Path], list[Path]]:
    """Files under ``root`` whose posix path relative to ``root`` matches a pattern, sorted; and the
    symlinks skipped because they point outside ``links_within`` (default ``root``) or nowhere.

    The walk never enters a symlinked folder (one pointing outside is counted as skipped whatever
    the patterns); a matching symlink to a file inside ``links_within`` counts as a file (its
    target's bytes are what get copied).
    """
    links_within = links_within or root
    found, refused = [], []
    for folder, dirs, names in os.walk(root, followlinks=False):
        dirs.sort()
        for name in dirs:  # os.walk lists symlinked folders here and does not enter them
            path = Path(folder) / name
            if path.is_symlink() and not (_inside(path, links_within) and path.is_dir()):
                refused.append(path)
        for name in sorted(names):
            path = Path(folder) / name
            if not any(fnmatch.fnmatch(path.relative_to(root).as_posix(), p) for p in patterns):
                continue
            if path.is_symlink() and not (_inside(path, links_within) and resolves_to_file(path)):
                refused.append(path)
            elif path.is_file():
                found.append(path)
    return sorted(found), sorted(refused)


def copy_files(root: Path, files: list[Path], out_dir: Path) -> list[Path]:
    """Copy each of ``files`` (under ``root``) to the same relative path under ``out_dir``; return the copies."""
    copies = []
    for src in files:
        dst = out_dir / src.relative_to(root)
        if not _inside(dst, out_dir):
            raise InputError(f"{src}: its destination {dst} would be outside {out_dir}; not copied")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)  # a symlink here is one to a file inside the allowed root
        copies.append(dst)
    return copies


def _warn_refused(refused: list[Path], where: Path) -> None:
    if refused:
        shown = ", ".join(f"{p} -> {os.readlink(p)}" for p in refused[:20])
        more = f" (and {len(refused) - 20} more)" if len(refused) > 20 else ""
        log.warning("skipped %d symlink(s) pointing outside %s or nowhere: %s%s", len(refused), where, shown, more)


def copy_local(repo_name: str, patterns: list[str], out_dir: Path) -> tuple[list[Path], int]:
    """Copy the matching files of the local directory ``repo_name`` into ``out_dir``; return the copies
    and the number of symlinks skipped."""
    repo = Path(repo_name).expanduser()
    if not repo.is_dir():
        raise InputError(f"source repo {repo_name!r} is not a directory (and not a hub id 'owner/name')")
    files, refused = matching_files(repo, patterns)
    _warn_refused(refused, repo)
    return copy_files(repo, files, out_dir), len(refused)


def hub_cache_dir(source: Source) -> str | None:
    """``source.cache_dir``, else env ``HF_HUB_CACHE``, else None (the hub's default cache)."""
    return source.cache_dir or os.environ.get("HF_HUB_CACHE") or None


def download_hub(
    repo_id: str, revision: str | None, patterns: list[str], out_dir: Path, cache_dir: str | None
) -> tuple[list[Path], int]:
    """``snapshot_download`` a dataset repo's matching files into the hub cache, copy them to ``out_dir``."""
    # lazy: only for hub repos (local folders need none of it)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        snapshot = Path(
            snapshot_download(
                repo_id=repo_id,
                repo_type="dataset",
                revision=revision,
                allow_patterns=patterns,
                cache_dir=cache_dir,
            )
        )
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise InputError(
            f"hub dataset {repo_id!r} (revision {revision!r}) not found or not accessible "
            f"(a gated or private repo needs HF_TOKEN): {err}"
        ) from None
    # <cache>/datasets--owner--name/snapshots/<commit>/<path> are symlinks to ../../blobs/<etag>
    repo_cache = snapshot.parents[1]
    files, refused = matching_files(snapshot, patterns, links_within=repo_cache)
    _warn_refused(refused, repo_cache)
    return copy_files(snapshot, files, out_dir), len(refused)
