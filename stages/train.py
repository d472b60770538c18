"""Stage ``train@<phase>``: train the UNet on the phase's latent mix, from the previous phase's weights.

Resumable: checkpoints in ``${paths.runs}/<phase>/`` (not a DVC output: they survive a killed ``dvc repro``); a
rerun continues from the newest good one mid-epoch, unless the phase's inputs changed (then the old run dir is
moved aside, never deleted: :mod:`sdforge.training.run_dir`). Output ``${paths.checkpoints}/<phase>/``:
``unet/``, ``unet_ema/``, ``state.json``, ``ledger.parquet``, ``adapter/`` / ``adapter_ema/`` (docs/ADAPTERS.md);
``${paths.metrics}/train_loss/<phase>.csv``. One process, torchrun ranks or a Kubernetes job:
:mod:`sdforge.training.cli`; the training itself: :mod:`sdforge.training.phase_training`.
"""

from __future__ import annotations

from pathlib import Path

from sdforge.config import Params
from sdforge.training.cli import train_cli
from sdforge.training.hooks import Hook
from sdforge.training.phase_training import train_phase
from sdforge.training.reporting import TrackingHook


def run(params: Params, phase_name: str, hooks: list[Hook] | tuple = ()) -> dict:
    """Train one phase (resuming if possible), export its weights, return its metrics (every rank; the export and
    the ledger's figures on rank 0). ``hooks`` watch the run (:mod:`sdforge.training.hooks`)."""
    return train_phase(params, phase_name, hooks)


def run_stage(params: Params, phase_name: str) -> dict:
    """Rank 0: :func:`run` with MLflow watching — step metrics, validation images, the final figures, and the
    train run's end (FINISHED, or KILLED / FAILED with the reason)."""
    run_dir = Path(params.paths.runs) / phase_name
    return run(params, phase_name, hooks=[TrackingHook(params, phase_name, run_dir)])


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.train --params params.yaml --item <phase>`` (:func:`sdforge.training.cli.train_cli`)."""
    train_cli(argv, run, run_stage)


if __name__ == "__main__":
    main()
