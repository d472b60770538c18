"""Stage ``condition_images@<source>``: the conditioning image of every latent, cropped exactly like it (ControlNet).

For each kind in ``conditions.kinds`` (Canny edges; thresholds under ``conditions.canny``) and each encoded
resolution: ``${paths.conditions}/<source>/<resolution>/<kind>/``, one file per latent shard file, row for row
(layout: :mod:`sdforge.control.shards`). Each sample is decoded from the source's input tar by the encoder's own
decoder and bucket crop, and checked against the crop its latent's manifest row records; a sample that is missing,
does not decode, or decodes to another crop has no condition: it is counted by reason in the metrics and named in
its shard's marker and the log. Content-keyed: a rerun redoes only the shards whose latent part, settings or OpenCV
changed (a killed run resumes at its first unfinished shard). Without kinds (the default) the folder holds only
``settings.json``. docs/CONTROL.md.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sdforge.config import Conditions, Params
from sdforge.control.shards import (
    SKIP_REASONS,
    DecodeRules,
    condition_shard,
    done_marker,
    remove_stale,
    settings_fingerprint,
    write_shard,
)
from sdforge.ingest.buckets import shapes_of
from sdforge.io import InputError, stage_cli, write_json
from sdforge.latents import s3_inputs, store
from sdforge.latents.inputs import list_inputs
from sdforge.latents.prefetch import Prefetcher
from sdforge.tracking import log_stage

log = logging.getLogger(__name__)

SETTINGS_FILE = "settings.json"
NAMED_SKIPS = 10
"""Skipped samples named in the log per shard (every one is in the shard's marker)."""


def run(
    cfg: Conditions, source: str, shard_dir: str | Path, latents_dir: Path, out_dir: Path,
    resolutions: dict[str, DecodeRules], workers: int = 2,
) -> dict:
    """Make ``cfg.kinds`` for every latent of ``latents_dir`` (a source's, one folder per resolution of
    ``resolutions``) from the input tars of ``shard_dir`` into ``out_dir``; the metrics."""
    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / SETTINGS_FILE, cfg.model_dump())
    _remove_unasked(out_dir, resolutions, cfg.kinds)
    if not cfg.kinds:
        return {"enabled": False, "conditions": 0, "seconds": round(time.perf_counter() - t0, 2)}
    tars = {t.shard: t for t in list_inputs(shard_dir)}
    totals: Counter = Counter()
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="condition") as pool:
        for name, rules in resolutions.items():
            for kind in cfg.kinds:
                got = _resolution(source, tars, latents_dir / name, out_dir / name / kind, kind, cfg, rules, pool)
                totals.update({f"{name}.{k}": v for k, v in got.items()})
                totals.update(got)
    figures = {k: int(totals.get(k, 0)) for k in ("conditions", "skipped", "shards_made", "shards_reused")}
    reasons = {f"skipped.{r}": int(totals.get(f"skipped.{r}", 0)) for r in SKIP_REASONS}
    per_resolution = {f"{name}.conditions": int(totals.get(f"{name}.conditions", 0)) for name in resolutions}
    return {"enabled": True, "kinds": list(cfg.kinds), **figures, **reasons, **per_resolution,
            "seconds": round(time.perf_counter() - t0, 2)}  # fmt: skip


def _resolution(
    source: str, tars: dict, latents: Path, out: Path, kind: str, cfg: Conditions, rules: DecodeRules, pool
) -> Counter:
    """One resolution's and kind's conditions: reuse the finished shards, make the rest; their counts."""
    parts = {store.shard_number(p.name): p for p in sorted(latents.glob(store.PART_PATTERN))}
    if not parts:
        raise InputError(f"{latents}: no latent shards (run encode_latents@{source} first)")
    out.mkdir(parents=True, exist_ok=True)
    remove_stale(out, set(parts))
    settings = getattr(cfg, kind).model_dump()
    fingerprint = settings_fingerprint(kind, settings, rules)
    counts: Counter = Counter()
    todo = []
    for shard, part in parts.items():
        stamp = {"source": source, "latent_part": _sha256(part), "settings": fingerprint}
        marker = done_marker(out, shard, stamp)
        if marker is not None:
            _count(counts, marker["conditions"], marker["skipped"], reused=True)
        elif shard not in tars:
            raise InputError(f"{part}: its input tar shard {shard:05d} is not in the source's shards; rerun "
                             f"encode_latents@{source} (it removes latents whose tar is gone)")  # fmt: skip
        else:
            todo.append((shard, part, stamp))
    _make(todo, tars, out, kind, settings, rules, pool, counts)
    log.info("%s: %d shard(s) reused, %d made", out, counts["shards_reused"], counts["shards_made"])
    return counts


def _make(todo: list, tars: dict, out: Path, kind: str, settings: dict, rules: DecodeRules, pool, counts) -> None:
    """Make and write each ``(shard, part, stamp)`` of ``todo`` (s3:// tars downloaded one ahead)."""
    with tempfile.TemporaryDirectory(prefix="condition-") as tmp:
        prefetch = Prefetcher([tars[shard] for shard, _, _ in todo], ahead=1, tmp_dir=tmp)
        try:
            for i, (shard, part, stamp) in enumerate(todo):
                local = prefetch.local_path(i)
                got = condition_shard(local, store.read_part(part)[0], rules, settings, pool)
                prefetch.done(local)
                write_shard(out, shard, kind, got, stamp)
                _name_skips(part, got.skipped)
                _count(counts, got.made, got.skipped, reused=False)
        finally:
            prefetch.close()


def _count(counts: Counter, made: int, skipped: dict[str, str], reused: bool) -> None:
    counts["conditions"] += made
    counts["skipped"] += len(skipped)
    counts.update(f"skipped.{why.split(':')[0]}" for why in skipped.values())
    counts["shards_reused" if reused else "shards_made"] += 1


def _name_skips(part: Path, skipped: dict[str, str]) -> None:
    for key, why in sorted(skipped.items())[:NAMED_SKIPS]:
        log.warning("%s: sample %s has no condition (%s)", part.name, key, why)
    if len(skipped) > NAMED_SKIPS:
        log.warning("%s: %d more samples without a condition (all named in the shard's marker)", part.name,
                    len(skipped) - NAMED_SKIPS)  # fmt: skip


def _remove_unasked(out_dir: Path, resolutions: dict, kinds: list[str]) -> None:
    """Remove the folders of resolutions and kinds no longer asked for (derived data, made again on demand)."""
    for res in (p for p in out_dir.iterdir() if p.is_dir()):
        for kind in (p for p in res.iterdir() if p.is_dir()):
            if res.name not in resolutions or kind.name not in kinds:
                log.warning("%s: not asked for any more (conditions.kinds, encode.resolutions); removed", kind)
                shutil.rmtree(kind)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def decode_rules(params: Params, source: str) -> dict[str, DecodeRules]:
    """Per encoded resolution: the buckets and decoding rules ``encode_latents`` cropped the source's images with."""
    sets, fetch = params.bucket_sets(), params.sources[source].fetch
    return {
        name: DecodeRules(tuple(shapes_of(sets[name])), params.encode.wrong_size, fetch.max_image_pixels,
                          fetch.max_caption_chars)  # fmt: skip
        for name in params.encoded_resolutions()
    }


def run_stage(params: Params, source: str) -> dict:
    """Resolve source ``source``'s paths from ``params``, run, log to MLflow."""
    paths = params.paths
    shards = f"{paths.shards.rstrip('/')}/{source}" if s3_inputs.is_s3(paths.shards) else Path(paths.shards) / source
    metrics = run(params.conditions, source, shards, Path(paths.latents) / source, Path(paths.conditions) / source,
                  decode_rules(params, source), params.encode.decode_workers)  # fmt: skip
    note = (f"- conditions `{source}`: {metrics['conditions']} ({', '.join(params.conditions.kinds)}), "
            f"{metrics.get('skipped', 0)} skipped" if metrics["enabled"] else f"- conditions `{source}`: none asked")
    log_stage(params.tracking, "data", f"condition_images@{source}", metrics, params.conditions.model_dump(),
              headline=("conditions",), note=note)  # fmt: skip
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.condition_images --params params.yaml --item <source>``."""
    stage_cli("condition_images", run_stage, argv=argv)


if __name__ == "__main__":
    main()
