"""Stage ``download_metadata@<source>``: a source's raw metadata / archives into ``paths.metadata/<source>/``.

``source.repo`` is either a local directory (the demo, tests, a pre-staged mirror) or a Hugging
Face dataset repo id. Either way the output holds only the files whose repo-relative path matches
one of ``source.allow_patterns`` (``fnmatch``, recursive, sorted), at their repo-relative paths.

* Local directory: the matching files are copied. Symlinks are never followed out of the source
  directory: one whose target is outside it (or missing) is skipped and named in a warning
  (metric ``skipped_symlinks``); one to a file inside it is copied as that file; symlinked
  folders are not descended (their files are reached by their real path).
* Hub: ``snapshot_download(cache_dir=...)`` into the hub cache (``source.cache_dir``, else env
  ``HF_HUB_CACHE``, else the hub's default), then the snapshot's matching files are copied out.
  The cache lives outside the output on purpose: DVC deletes a stage's outputs before it runs it
  again, so progress kept there would be lost. A killed download resumes file by file: files that
  completed are blobs in the cache and are not fetched again. (huggingface_hub 2.x writes each file
  to a process-unique ``<etag>.<uuid>.incomplete`` and deletes it on error, so a file cut off by a
  kill restarts from zero; within one process, dropped connections are resumed with HTTP ranges.)

Every destination is checked to lie inside the output folder before anything is written.
Metrics: ``files``, ``bytes``, ``skipped_symlinks``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sdforge.config import Params, Source
from sdforge.ingest.metadata import copy_local, download_hub, hub_cache_dir, is_local
from sdforge.io import InputError, fresh_folder, stage_cli
from sdforge.tracking import log_stage

log = logging.getLogger(__name__)


def run(source: Source, out_dir: str | Path) -> dict[str, int]:
    """Fill ``out_dir`` (emptied first) with the source's matching files; return the metrics."""
    out_dir = Path(out_dir)
    fresh_folder(out_dir, "the downloaded metadata", setting="paths.metadata")
    if is_local(source.repo):
        files, skipped = copy_local(source.repo, source.allow_patterns, out_dir)
        where = "local directory"
    else:
        cache_dir = hub_cache_dir(source)
        files, skipped = download_hub(source.repo, source.revision, source.allow_patterns, out_dir, cache_dir)
        where = "hub dataset"
    if not files:
        raise InputError(f"{where} {source.repo!r} has no files matching allow_patterns {source.allow_patterns}")
    size = sum(f.stat().st_size for f in files)
    log.info("%d files (%d bytes) from %s %s into %s", len(files), size, where, source.repo, out_dir)
    return {"files": len(files), "bytes": size, "skipped_symlinks": skipped}


def run_stage(params: Params, item: str) -> dict:
    """Resolve source ``item``'s paths from ``params``, run, log to MLflow."""
    source = params.sources[item]
    metrics = run(source, Path(params.paths.metadata) / item)
    log_stage(
        params.tracking,
        "data",
        f"download_metadata@{item}",
        metrics,
        {"repo": source.repo, "revision": source.revision, "allow_patterns": source.allow_patterns},
        headline=("files", "bytes"),
        note=f"- download `{item}`: {metrics['files']} file(s), {metrics['bytes'] / 1e6:.3g} MB from `{source.repo}`",
    )
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.download_metadata --params params.yaml --item <source>``."""
    stage_cli("download_metadata", run_stage, argv=argv)


if __name__ == "__main__":
    main()
