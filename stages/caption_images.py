"""Stage ``caption_images@<source>``: a vision-language model rewrites the source's captions, cached by content.

With ``sources.<source>.recaption`` set, every WebDataset shard of ``paths.shards/<source>`` gets a parquet
``paths.captions/<source>/<shard>.parquet`` (columns in :mod:`sdforge.captions.shards`): the original caption, the
synthetic one (the original where the generation was rejected or the image unreadable), the model id and
revision, the prompt's sha256, the CLIP token count and the truncated-at-cap flag. ``encode_latents`` tokenizes
both captions; a phase's ``caption_mix`` picks one per (seed, sample, epoch).

Captions are keyed by (image sha256, model, revision, prompt, generation settings): a rerun after adding shards
captions only the new ones, a killed run resumes at its first unfinished shard, a changed prompt or model
recaptions everything and says so (``stale``). Without ``recaption`` the folder holds no parquet and
``encode_latents`` uses the originals. ``settings.json`` records what the folder was made with.

MLflow (``caption_images@<source>`` under ``data``): progress and ETA per shard while it runs, then a table of
sampled images with both captions, the token-length histogram and the truncation and rejection rates.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from sdforge.captions.models import captioner_for, recaption_fingerprint, resolve_model
from sdforge.captions.report import caption_summary, length_figure, sample_table
from sdforge.captions.shards import Captioning, EtaLog, caption_shards, remove_orphans
from sdforge.config import Params, Recaption
from sdforge.io import InputError, stage_cli, write_json
from sdforge.tracking import stage_run, summarise

log = logging.getLogger(__name__)

SETTINGS_FILE = "settings.json"
TABLE_ROWS = 24
"""Images in the MLflow table of original vs synthetic captions."""


def token_counter(models_dir: Path):
    """Counts a caption's CLIP tokens (with BOS/EOS) with the pipeline's tokenizer."""
    from transformers import CLIPTokenizer  # lazy: ~1-2 s to import, and most sources are not captioned (no rec)

    tokenizer = CLIPTokenizer.from_pretrained(models_dir / "tokenizer")
    # the whole length is the point here (the report's distribution); verbose=False: no "longer than the
    # maximum sequence length" warning, which is about feeding the ids to the model, as this never does
    return lambda text: len(tokenizer(text, truncation=False, verbose=False).input_ids)


def captioning(
    rec: Recaption, models_dir: Path, max_pixels: int | None = None, max_caption_chars: int | None = None
) -> Captioning:
    """The run's settings, fingerprint and (lazily loaded) captioner; ``max_caption_chars``: the source's
    ``fetch.max_caption_chars`` (captions read and made are cut to it); ``max_pixels``: the source's
    ``fetch.max_image_pixels`` (a bigger image is not decoded)."""
    model, revision = resolve_model(rec.model, rec.revision, models_dir)
    shorten_revision = resolve_model(rec.shorten.model, rec.shorten.revision, models_dir)[1] if rec.shorten else None
    return Captioning(
        model=model,
        revision=revision,
        fingerprint=recaption_fingerprint(rec, model, revision, shorten_revision),
        prompt=rec.prompt,
        generate=captioner_for(rec, model, revision),
        count_tokens=token_counter(models_dir),
        batch_size=rec.batch_size,
        max_tokens=rec.max_tokens,
        max_pixels=max_pixels,
        max_caption_chars=max_caption_chars,
    )


def run(
    rec: Recaption | None, shards_dir: Path | str, models_dir: Path, out_dir: Path, on_progress=None,
    max_pixels: int | None = None, max_caption_chars: int | None = None,
) -> dict:
    """Caption ``shards_dir``'s tars into ``out_dir`` (or, without ``rec``, leave it without captions); metrics."""
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    if rec is None:  # the shards are not read: they may live on S3 (encode_latents reads s3:// shards)
        removed = remove_orphans(out_dir, [])
        write_json(out_dir / SETTINGS_FILE, {"recaption": None})
        return {"enabled": False, "shards_removed": removed}
    if str(shards_dir).startswith("s3:/"):
        raise InputError(f"{shards_dir}: caption_images reads local shards; set paths.shards to a local folder")
    tars = sorted(Path(shards_dir).glob("*.tar"))
    if not tars:
        raise InputError(f"{shards_dir}: no .tar shards found (did fetch_images run?)")
    run_ = captioning(rec, models_dir, max_pixels, max_caption_chars)
    stats = caption_shards(Path(shards_dir), out_dir, run_, on_progress)
    if stats.stale:
        log.warning("%d image(s) had captions made with other settings: recaptioned", stats.stale)
    write_json(out_dir / SETTINGS_FILE, {"recaption": rec.model_dump(), "model": run_.model,
                                         "revision": run_.revision, "fingerprint": run_.fingerprint})  # fmt: skip
    seconds = time.perf_counter() - t0
    return {
        "enabled": True,
        "shards": len(tars),
        **{f"run.{k}": v for k, v in stats.as_metrics().items()},
        **caption_summary(out_dir, rec.max_tokens),
        "images_per_second": round(stats.captioned / seconds, 3) if stats.captioned else None,
        "seconds": round(seconds, 2),
    }


def _log_outputs(mlflow, name: str, metrics: dict, out_dir: Path, shards_dir: Path) -> None:
    """The stage's metrics, the captions table and the length histogram; the parent's summary."""
    mlflow.log_metrics({k: float(v) for k, v in metrics.items() if isinstance(v, int | float)})
    mlflow.log_dict(metrics, f"caption_images/{name}.json")
    if not metrics["enabled"] or mlflow.active_run() is None:  # originals only, or tracking off
        summarise(mlflow, note=f"- captions `{name}`: originals only (no `recaption`)")
        return
    mlflow.log_table(sample_table(out_dir, shards_dir, TABLE_ROWS), artifact_file=f"caption_images/{name}_samples.json")
    mlflow.log_figure(length_figure(out_dir, metrics), f"caption_images/{name}_tokens.png")
    note = (
        f"- captions `{name}`: {metrics['images']} images, {metrics['synthetic']} synthetic "
        f"({metrics['rejected']} kept their original: {metrics['rejected_by_reason']}), "
        f"{metrics['run.captioned']} captioned now, {metrics['run.cached']} cached, {metrics['run.stale']} stale; "
        f"median {metrics['tokens.p50']} tokens, truncation rate {metrics['truncation_rate']:.1%}"
    )
    summarise(mlflow, metrics={k: metrics[k] for k in ("synthetic", "rejected", "truncation_rate")}, note=note)


def run_stage(params: Params, item: str) -> dict:
    """Resolve source ``item``'s paths from ``params``, run with MLflow progress, log the results."""
    rec = params.sources[item].recaption
    paths = params.paths
    out_dir = Path(paths.captions) / item
    config = {"recaption": rec.model_dump() if rec else None}
    live = rec is not None  # a captioning model's progress is watched live; copying the originals takes seconds
    with stage_run(params.tracking, "data", f"caption_images@{item}", config, deferrable=not live) as mlflow:

        def progress(figures: dict) -> None:
            mlflow.log_metrics({f"progress.{k}": float(v) for k, v in figures.items()}, step=figures["captioned"])

        shards = f"{paths.shards.rstrip('/')}/{item}" if paths.shards.startswith("s3://") else Path(paths.shards) / item
        fetch = params.sources[item].fetch
        metrics = run(
            rec, shards, Path(paths.models), out_dir, EtaLog(item, progress), fetch.max_image_pixels,
            fetch.max_caption_chars,
        )  # fmt: skip
        metrics = {k: v for k, v in metrics.items() if v is not None}
        _log_outputs(mlflow, item, metrics, out_dir, Path(shards))
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.caption_images --params params.yaml --item <source>``."""
    stage_cli("caption_images", run_stage, argv=argv)


if __name__ == "__main__":
    main()
