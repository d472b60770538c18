"""Stage ``make_demo_data``: the synthetic corpus, in the real sources' on-disk formats.

Writes ``paths.demo_source/``:

* ``laion/part-00000.parquet``: LAION metadata (``URL, TEXT, WIDTH, HEIGHT, similarity, punsafe,
  pwatermark, AESTHETIC_SCORE, hash``). ``demo.laion_rows`` good rows whose images are served,
  ``demo.missing_rows`` good rows whose URL 404s, and rows the quality filter must drop (low
  aesthetic, watermark, NSFW, small, duplicate URL / hash of an earlier good row).
* ``http/images/<name>.jpg``: the good rows' images (served on loopback by ``fetch_images``).
* ``diffusiondb/part-000001.zip``: ``demo.archive_images`` PNGs plus ``part-000001.json``
  (file name → ``{"p", "se", "c", "st", "sa"}``), DiffusionDB 2M's layout.
* ``concept/NNNNN.png`` + ``NNNNN.txt``: ``demo.concept.images`` images of the concept colour only (a
  ``local`` source), which nothing above shows: what the demo's adapter phase teaches.

Everything derives from ``demo.seed``; the bytes are identical run to run (fixed JPEG quality,
fixed zip dates, sorted entries). With ``demo.enabled: false`` only a ``DISABLED`` marker is
written, so the DVC output exists at full scale.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from sdforge.config import DemoData, Params
from sdforge.demo.corpus import build
from sdforge.io import fresh_folder, stage_cli
from sdforge.tracking import log_stage

log = logging.getLogger(__name__)


def run(cfg: DemoData, out_dir: str | Path) -> dict[str, int]:
    """Rebuild ``out_dir`` from scratch (built beside it, then swapped in); return metrics.

    Metrics: ``enabled`` and, when enabled, the count of each row kind (see :func:`sdforge.demo.corpus.laion_rows`)
    and ``archive_images``.
    """
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    fresh_folder(tmp, "the demo corpus", setting="paths.demo_source")
    if cfg.enabled:
        metrics: dict[str, int] = {"enabled": 1, **build(cfg, tmp)}
    else:
        (tmp / "DISABLED").write_bytes(b"")
        metrics = {"enabled": 0}
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    log.info("demo source written to %s", out_dir)
    return metrics


def run_stage(params: Params, _item: None) -> dict:
    """Resolve the demo corpus' paths from ``params``, run, log to MLflow."""
    metrics = run(params.demo, params.paths.demo_source)
    note = "**Demo corpus**: off (demo.enabled: false)"
    if metrics.get("enabled"):
        note = (
            f"**Demo corpus**: {metrics['good_rows']} good LAION-schema rows of {metrics['laion_rows_total']} (the "
            f"rest are bad rows the filter must drop), {metrics['archive_images']} DiffusionDB-format images"
        )
    headline = ("laion_rows_total", "good_rows", "archive_images")
    log_stage(
        params.tracking, "data", "make_demo_data", metrics, params.demo.model_dump(), headline=headline, note=note
    )
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.make_demo_data --params params.yaml``."""
    stage_cli("make_demo_data", run_stage, needs_item=False, argv=argv)


if __name__ == "__main__":
    main()
