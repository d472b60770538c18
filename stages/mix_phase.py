"""Stage ``mix_phase@<phase>``: a phase's (source, fraction or count) mix → a seeded training index.

Output ``${paths.mixes}/<phase>.parquet`` with columns ``source, shard, bucket_width, bucket_height, row,
key`` pointing into the latent store at the phase's resolution (``phases.<p>.resolution``: the folder
``${paths.latents}/<source>/<resolution>/``) — no copies, no symlinks. The same seed gives the same
index on any machine (its SHA-256, :func:`index_digest`, is logged to MLflow; a test pins one). A source
too small for its share is an error unless the phase says ``with_replacement: true``.

Before drawing, ``train.held_out`` samples of each source are split off (the same keys in every phase:
:func:`sdforge.latents.mix.split_held_out`) into ``<phase>.held_out.parquet`` (same columns), which the train
stage's validation loss reads and no phase trains on.
"""

from __future__ import annotations

import hashlib
import io
import logging
import zlib
from pathlib import Path

import numpy as np
import polars as pl

from sdforge.config import Params, Phase
from sdforge.control.records import write_conditions_record
from sdforge.io import InputError, atomic_write_bytes, held_out_path, read_parquet_checked, stage_cli
from sdforge.latents.mix import BUCKET_COLUMNS, index_columns, split_counts, split_held_out
from sdforge.latents.store import MANIFEST, resolution_dir
from sdforge.tracking import stage_run, summarise

log = logging.getLogger(__name__)

def requested_counts(phase_name: str, phase: Phase) -> dict[str, int]:
    """Samples asked of each source: the mix's counts, or its fractions of ``samples``; none may be 0."""
    counts = dict(phase.mix) if phase.mix_is_counts else split_counts(phase.mix, phase.samples)
    for source, n in counts.items():
        if n == 0:
            raise InputError(
                f"phases.{phase_name}: source '{source}' at fraction {phase.mix[source]} gets 0 of "
                f"{phase.samples} samples; raise phases.{phase_name}.samples or its fraction, or drop it from the mix"
            )
    return counts


def phase_seed(seed: int, phase: str) -> int:
    """A per-phase seed that is stable across Python processes and machines."""
    return (seed * 1_000_003 + zlib.crc32(phase.encode())) % 2**32


def build_index(phase_name: str, phase: Phase, manifests: dict[str, pl.DataFrame], seed: int) -> pl.DataFrame:
    """Draw each source's share of the phase from its manifest; raise if a source is too small.

    Sources are drawn in name order from one ``numpy.random.default_rng`` (PCG64: the same stream on
    every platform), ``count`` picks from each manifest's (shard, row)-sorted rows, without or with
    replacement as the phase says; the concatenation is then shuffled once so sources interleave.
    Rows are sorted by (shard, bucket, row): with one square bucket, the order before buckets existed.
    """
    rng = np.random.default_rng(phase_seed(seed, phase_name))
    parts = []
    for source, count in sorted(requested_counts(phase_name, phase).items()):
        manifest = manifests[source].sort(["shard", *BUCKET_COLUMNS, "row"])
        available = manifest.height
        if available == 0:
            raise InputError(f"phases.{phase_name}: source '{source}' has no samples in its latent store")
        if count > available and not phase.with_replacement:
            raise InputError(
                f"phases.{phase_name}: source '{source}' has {available} samples to train on but the mix asks "
                f"for {count}; lower phases.{phase_name}.samples (or train.held_out, the samples held out of "
                f"every source) or set phases.{phase_name}.with_replacement: true"
            )
        picks = rng.choice(available, size=count, replace=phase.with_replacement)
        parts.append(index_columns(manifest[picks], source))
    index = pl.concat(parts)
    return index[rng.permutation(index.height)]


def index_digest(index: pl.DataFrame) -> str:
    """SHA-256 of the index's (source, shard, bucket, row, key) rows as text: equal digests, equal training order."""
    digest = hashlib.sha256()
    for source, shard, bw, bh, row, key in index.select("source", "shard", *BUCKET_COLUMNS, "row", "key").iter_rows():
        digest.update(f"{source}\t{shard}\t{bw}x{bh}\t{row}\t{key}\n".encode())
    return digest.hexdigest()


def read_manifest(latents_dir: Path, source: str, resolution: str) -> pl.DataFrame:
    """``source``'s latent manifest at ``resolution``, checked for the columns the index needs and unique
    (shard, bucket, row)."""
    path = resolution_dir(latents_dir, source, resolution) / MANIFEST
    remedy = f"re-run encode_latents@{source} (is '{resolution}' in encode.resolutions?)"
    manifest = read_parquet_checked(path, {"key", "shard", "row", *BUCKET_COLUMNS}, remedy)
    if manifest.select("shard", *BUCKET_COLUMNS, "row").is_duplicated().any():
        raise InputError(f"{path}: manifest lists a (shard, bucket, row) twice; re-run encode_latents@{source}")
    return manifest


def run(
    phase_name: str, phase: Phase, latents_dir: Path, out_path: Path, seed: int, resolution: str, held_out: int = 0,
    conditions_dir: Path | None = None,
) -> dict:  # fmt: skip
    """Write the phase index parquet, its held-out companion and its conditions record (a ControlNet phase's
    condition shards, from ``conditions_dir``); return requested vs obtained composition, held-out and per-bucket
    metrics."""
    manifests = {source: read_manifest(latents_dir, source, resolution) for source in phase.mix}
    manifests, held = split_held_out(manifests, held_out)
    index = build_index(phase_name, phase, manifests, seed)
    for frame, path in ((index, out_path), (held, held_out_path(out_path))):
        buf = io.BytesIO()
        frame.write_parquet(buf)
        atomic_write_bytes(path, buf.getvalue())
    kind = phase.controlnet.condition if phase.controlnet is not None else None
    shards = set(pl.concat([index, held]).select("source", "shard").unique().iter_rows())
    write_conditions_record(out_path, kind, shards, conditions_dir, resolution)
    obtained = dict(index.group_by("source").len().iter_rows())
    requested = requested_counts(phase_name, phase)
    metrics: dict = {"samples": index.height, "unique_samples": index.unique(["source", "key"]).height}
    for source in sorted(phase.mix):
        n = obtained.get(source, 0)
        fraction = requested[source] / phase.samples if phase.mix_is_counts else phase.mix[source]
        metrics[f"requested_fraction.{source}"] = round(fraction, 6)
        metrics[f"obtained_fraction.{source}"] = round(n / index.height, 6)
        metrics[f"requested.{source}"] = requested[source]
        metrics[f"samples.{source}"] = n
        metrics[f"available.{source}"] = manifests[source].height
        metrics[f"held_out.{source}"] = held.filter(pl.col("source") == source).height
    metrics["held_out"] = held.height
    for bw, bh, n in index.group_by(*BUCKET_COLUMNS).len().sort(BUCKET_COLUMNS).iter_rows():
        metrics[f"bucket.{bw}x{bh}"] = n
    return metrics


def _composition_figure(metrics: dict):
    # lazy: matplotlib (~0.5 s) only to draw the figure
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after matplotlib.use("Agg")

    sources = sorted(k.split(".", 1)[1] for k in metrics if k.startswith("requested_fraction."))
    x = np.arange(len(sources))
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(x - 0.2, [metrics[f"requested_fraction.{s}"] for s in sources], 0.4, label="requested")
    ax.bar(x + 0.2, [metrics[f"obtained_fraction.{s}"] for s in sources], 0.4, label="obtained")
    ax.set_xticks(x, sources)
    ax.set_ylabel("fraction")
    ax.legend()
    fig.tight_layout()
    return fig


def run_stage(params: Params, phase_name: str) -> dict:
    """Resolve phase ``phase_name``'s paths from ``params``, run, log to MLflow."""
    phase = params.phases[phase_name]
    metrics = run(
        phase_name,
        phase,
        Path(params.paths.latents),
        Path(params.paths.mixes) / f"{phase_name}.parquet",
        params.train.seed,
        params.phase_resolution(phase_name),
        params.train.held_out,
        Path(params.paths.conditions),
    )

    digest = index_digest(pl.read_parquet(Path(params.paths.mixes) / f"{phase_name}.parquet"))
    logged = {"mix": phase.mix, "samples": phase.samples, "with_replacement": phase.with_replacement}
    parent_params = {"phase": phase.model_dump()}
    index = Path(params.paths.mixes) / f"{phase_name}.parquet"
    logged["index_sha256"] = digest
    with stage_run(params.tracking, phase_name, "mix_phase", logged, parent_params, deferrable=True) as mlflow:
        mlflow.log_metrics(metrics)
        mlflow.log_figure(_composition_figure(metrics), "mix_composition.png")
        headline = {k: v for k, v in metrics.items() if k == "samples" or k.startswith("samples.")}
        summarise(mlflow, metrics=headline, note=mix_note(phase_name, phase, metrics, index))
    return metrics


def mix_note(phase_name: str, phase: Phase, metrics: dict, index: Path) -> str:
    """The data section of the phase's MLflow description: its purpose and where its samples come from."""
    parts = [
        f"{source} {metrics[f'samples.{source}']} ({metrics[f'obtained_fraction.{source}']:.0%})"
        for source in sorted(phase.mix)
        if f"samples.{source}" in metrics
    ]
    title = f"### {phase_name}" + (f": {phase.description}" if phase.description else "")
    return f"{title}\n\n**Data**: {metrics['samples']} samples: {', '.join(parts)}; index `{index}`."


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.mix_phase --params params.yaml --item <phase>``."""
    stage_cli("mix_phase", run_stage, argv=argv)


if __name__ == "__main__":
    main()
