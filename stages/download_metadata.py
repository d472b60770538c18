"""Stage ``download_metadata@<source>``: a source's raw metadata / archives into ``paths.metadata/<source>/``.

``source.repo`` is either a local directory (the demo, tests, a pre-staged mirror) or a Hugging
Face dataset repo id. Local: copy the files whose repo-relative path matches one of
``source.allow_patterns`` (``fnmatch``, recursive, sorted). Hub: ``snapshot_download`` with the
same patterns and ``source.revision``. Either way the output holds only the matched files
(laion parquet shards, diffusiondb zips), at their repo-relative paths.
"""

from __future__ import annotations

import fnmatch
import logging
import shutil
from pathlib import Path

from stages.common import InputError, stage_cli
from stages.config import Source

log = logging.getLogger(__name__)

HUB_CACHE_DIR = ".cache"
"""``snapshot_download(local_dir=...)`` keeps its bookkeeping here; not part of the output."""


def is_local(repo: str) -> bool:
    """A local path rather than a hub id (``owner/name``): it exists, is absolute/relative-marked,
    or has other than exactly one ``/``."""
    return Path(repo).exists() or repo.startswith(("/", ".", "~")) or repo.count("/") != 1


def matching_files(root: Path, patterns: list[str]) -> list[Path]:
    """Files under ``root`` whose posix path relative to ``root`` matches any pattern, sorted."""
    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and any(fnmatch.fnmatch(rel, p) for p in patterns):
            found.append(path)
    return found


def copy_local(repo_name: str, patterns: list[str], out_dir: Path) -> list[Path]:
    """Copy the matching files of the local directory ``repo_name`` into ``out_dir``; return the copies."""
    repo = Path(repo_name).expanduser()
    if not repo.is_dir():
        raise InputError(f"source repo {repo_name!r} is not a directory (and not a hub id 'owner/name')")
    copies = []
    for src in matching_files(repo, patterns):
        dst = out_dir / src.relative_to(repo)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
        copies.append(dst)
    return copies


def download_hub(repo_id: str, revision: str | None, patterns: list[str], out_dir: Path) -> list[Path]:
    """``snapshot_download`` a dataset repo's matching files into ``out_dir``; return them."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        snapshot_download(
            repo_id=repo_id,
            repo_type="dataset",
            revision=revision,
            allow_patterns=patterns,
            local_dir=out_dir,
        )
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise InputError(f"hub dataset {repo_id!r} (revision {revision!r}) not found: {err}") from None
    shutil.rmtree(out_dir / HUB_CACHE_DIR, ignore_errors=True)
    return matching_files(out_dir, patterns)


def run(source: Source, out_dir: str | Path) -> dict[str, int]:
    """Fill ``out_dir`` (emptied first) with the source's matching files; return ``files`` and ``bytes``."""
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    if is_local(source.repo):
        files = copy_local(source.repo, source.allow_patterns, out_dir)
        where = "local directory"
    else:
        files = download_hub(source.repo, source.revision, source.allow_patterns, out_dir)
        where = "hub dataset"
    if not files:
        raise InputError(f"{where} {source.repo!r} has no files matching allow_patterns {source.allow_patterns}")
    size = sum(f.stat().st_size for f in files)
    log.info("%d files (%d bytes) from %s %s into %s", len(files), size, where, source.repo, out_dir)
    return {"files": len(files), "bytes": size}


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.download_metadata --params params.yaml --item <source>``."""
    stage_cli("download_metadata", _stage, argv=argv)


def _stage(params, item: str) -> dict:
    from stages.tracking import log_stage

    source = params.sources[item]
    metrics = run(source, Path(params.paths.metadata) / item)
    log_stage(
        params.tracking,
        "data",
        f"download_metadata@{item}",
        metrics,
        {"repo": source.repo, "revision": source.revision, "allow_patterns": source.allow_patterns},
    )
    return metrics


if __name__ == "__main__":
    main()
