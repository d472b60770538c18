"""Stage ``mix_phase@<phase>``: a phase's (source, fraction) mix → a seeded training index.

Output ``${paths.mixes}/<phase>.parquet`` with columns ``source, shard, row, key`` pointing into
the latent store — no copies, no symlinks. The same seed gives the same index on any machine.
"""

from __future__ import annotations

import io
import logging
import zlib
from pathlib import Path

import numpy as np
import polars as pl

from stages.common import InputError, atomic_write_bytes, stage_cli
from stages.config import Params, Phase

log = logging.getLogger(__name__)


def split_counts(mix: dict[str, float], total: int) -> dict[str, int]:
    """Integer sample counts per source summing exactly to ``total`` (largest remainder, ties by name)."""
    raw = {name: frac * total for name, frac in mix.items()}
    counts = {name: int(np.floor(v)) for name, v in raw.items()}
    short = total - sum(counts.values())
    by_remainder = sorted(raw, key=lambda n: (-(raw[n] - counts[n]), n))
    for name in by_remainder[:short]:
        counts[name] += 1
    return counts


def phase_seed(seed: int, phase: str) -> int:
    """A per-phase seed that is stable across Python processes and machines."""
    return (seed * 1_000_003 + zlib.crc32(phase.encode())) % 2**32


def build_index(phase_name: str, phase: Phase, manifests: dict[str, pl.DataFrame], seed: int) -> pl.DataFrame:
    """Draw each source's share of the phase from its manifest; raise if a source is too small."""
    rng = np.random.default_rng(phase_seed(seed, phase_name))
    parts = []
    for source, count in sorted(split_counts(phase.mix, phase.samples).items()):
        manifest = manifests[source].sort(["shard", "row"])
        available = manifest.height
        if count > available and not phase.with_replacement:
            raise InputError(
                f"phases.{phase_name}: source '{source}' has {available} samples but the mix asks for "
                f"{count}; lower phases.{phase_name}.samples or set phases.{phase_name}.with_replacement: true"
            )
        if available == 0:
            raise InputError(f"phases.{phase_name}: source '{source}' has no samples in its latent store")
        picks = rng.choice(available, size=count, replace=phase.with_replacement)
        parts.append(manifest[picks.tolist()].select("source", "shard", "row", "key"))
    index = pl.concat(parts)
    order = rng.permutation(index.height)
    return index[order.tolist()]


def run(phase_name: str, phase: Phase, latents_dir: Path, out_path: Path, seed: int) -> dict:
    """Write the phase index parquet; return requested vs obtained composition metrics."""
    manifests = {}
    for source in phase.mix:
        path = latents_dir / source / "manifest.parquet"
        if not path.is_file():
            raise InputError(f"{path}: latent manifest missing for source '{source}' (run encode_latents@{source})")
        manifests[source] = pl.read_parquet(path)
    index = build_index(phase_name, phase, manifests, seed)
    buf = io.BytesIO()
    index.write_parquet(buf)
    atomic_write_bytes(out_path, buf.getvalue())
    obtained = index.group_by("source").len().sort("source")
    metrics: dict = {"samples": index.height, "unique_samples": index.unique(["source", "key"]).height}
    for source, n in obtained.iter_rows():
        metrics[f"requested_fraction.{source}"] = phase.mix[source]
        metrics[f"obtained_fraction.{source}"] = round(n / index.height, 6)
        metrics[f"samples.{source}"] = n
        metrics[f"available.{source}"] = manifests[source].height
    return metrics


def _composition_figure(metrics: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def _run_stage(params: Params, phase_name: str) -> dict:
    phase = params.phases[phase_name]
    metrics = run(
        phase_name,
        phase,
        Path(params.paths.latents),
        Path(params.paths.mixes) / f"{phase_name}.parquet",
        params.train.seed,
    )
    from stages.tracking import stage_run

    with stage_run(params.tracking, phase_name, "mix_phase", {"mix": phase.mix, "samples": phase.samples}) as mlflow:
        mlflow.log_metrics(metrics)
        mlflow.log_figure(_composition_figure(metrics), "mix_composition.png")
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.mix_phase --params params.yaml --item <phase>``."""
    stage_cli("mix_phase", _run_stage, argv=argv)


if __name__ == "__main__":
    main()
