"""Helpers every stage module shares: the thin CLI, atomic writes, metrics JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from sdforge.config import ConfigError, Params, load_params

log = logging.getLogger(__name__)


def setup_logging() -> None:
    """Log to stderr at INFO with the module name (stages run as subprocesses of DVC)."""
    logging.basicConfig(
        level=os.environ.get("SDFORGE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@contextlib.contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """Open a temp file beside ``path`` for writing; on success fsync it and rename it over ``path``.

    On any exception the temp file (``.<name>.*.tmp``) is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same directory and ``os.replace``."""
    with atomic_file(path) as fh:
        fh.write(data)


def write_json(path: str | Path, obj: Any) -> None:
    """Atomically write ``obj`` as pretty JSON."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def metrics_path(params: Params, stage: str, item: str | None = None) -> Path:
    """``paths.metrics/<stage>/<item>.json`` (or ``<stage>.json`` for a single stage)."""
    base = Path(params.paths.metrics)
    return base / stage / f"{item}.json" if item else base / f"{stage}.json"


LOSS_CURVE = "train_loss"
"""``paths.metrics/train_loss/<phase>.csv``: a phase's ``step,loss,lr`` curve, written by ``train`` (a DVC plot)
and read by ``report``."""


def loss_curve_path(metrics_dir: str | Path, phase: str) -> Path:
    """Where phase ``phase``'s loss curve is (:data:`LOSS_CURVE`)."""
    return Path(metrics_dir) / LOSS_CURVE / f"{phase}.csv"


def held_out_path(index_path: str | Path) -> Path:
    """A phase index's held-out companion: ``<phase>.parquet`` → ``<phase>.held_out.parquet`` (written by
    ``mix_phase``, read by the training's held-out loss; here, not in the polars-using ``sdforge.latents.mix``, so
    the train stage imports no polars — the GPU image has none: bench/gpu/wheels.txt)."""
    return Path(index_path).with_suffix(".held_out.parquet")


def stage_cli(
    stage: str,
    run: Callable[[Params, str | None], dict[str, Any]],
    *,
    needs_item: bool = True,
    argv: list[str] | None = None,
) -> dict[str, Any]:
    """Parse ``--params`` / ``--item``, run the stage, write its metrics JSON, return the metrics
    (:func:`stage_args` + :func:`run_stage_command`)."""
    args = stage_args(stage, argv, needs_item)
    return run_stage_command(stage, run, args.params, getattr(args, "item", None), needs_item)


def stage_args(stage: str, argv: list[str] | None = None, needs_item: bool = True) -> argparse.Namespace:
    """A stage's command line: ``--params`` (default ``params.yaml``) and, for a foreach stage, ``--item``."""
    parser = argparse.ArgumentParser(prog=f"python -m stages.{stage}")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    if needs_item:
        parser.add_argument("--item", required=True, help="source or phase name (the foreach key)")
    return parser.parse_args(argv)


def run_stage_command(
    stage: str,
    run: Callable[[Params, str | None], dict[str, Any]],
    params_file: str | Path,
    item: str | None,
    needs_item: bool = True,
) -> dict[str, Any]:
    """Load the params, run the stage, write its metrics JSON, return the metrics.

    ``run(params, item)`` does the work and returns a flat dict of metrics; it writes its own
    outputs. A :class:`ConfigError` or a ``ValueError`` raised for bad input exits with the
    message (no traceback) and status 2.
    """
    setup_logging()
    try:
        params = load_params(params_file)
        if needs_item:
            _check_item(params, stage, item)
        metrics = run(params, item)
    except (ConfigError, InputError) as err:
        log.error("%s", err)
        raise SystemExit(2) from None
    write_json(metrics_path(params, stage, item), metrics)
    log.info("%s%s done: %s", stage, f"@{item}" if item else "", metrics)
    return metrics


class InputError(ValueError):
    """Bad input data that the user must fix; the message names the file/row/key."""


def read_parquet_checked(path: Path, required: set[str], remedy: str):
    """Read ``path`` as a polars frame that has the ``required`` columns; :class:`InputError` otherwise.

    A missing, unreadable or column-short file is reported with its path and ``remedy`` (what to re-run).
    """
    # lazy: polars (~0.3 s); io is imported by every stage CLI, few read parquet
    import polars as pl

    if not path.is_file():
        raise InputError(f"{path}: missing ({remedy})")
    try:
        frame = pl.read_parquet(path)
    except (OSError, pl.exceptions.PolarsError) as err:
        raise InputError(f"{path}: unreadable parquet ({type(err).__name__}: {err}); {remedy}") from None
    missing = sorted(required - set(frame.columns))
    if missing:
        raise InputError(f"{path}: lacks column(s) {missing}; {remedy}")
    return frame


def _check_item(params: Params, stage: str, item: str | None) -> None:
    names = set(params.sources) | set(params.phases)
    if item not in names:
        raise ConfigError(
            f"stages.{stage}: --item '{item}' is neither a source {sorted(params.sources)} "
            f"nor a phase {params.phase_names()}"
        )


UNPICKLE_REFUSED = "it holds pickled Python objects besides tensors, and such files are never unpickled"


def load_failure(err: BaseException, with_type: bool = False) -> str:
    """Why an untrusted file did not load, in one line (optionally prefixed by the error's type).

    torch's advice to re-run ``torch.load`` with ``weights_only=False`` is never passed on: that would run
    whatever code a pickle carries.
    """
    text = str(err).strip()
    if isinstance(err, pickle.UnpicklingError) or "weights_only" in text:
        return UNPICKLE_REFUSED
    if not text:
        return type(err).__name__
    return f"{type(err).__name__}: {text.splitlines()[0]}" if with_type else text.splitlines()[0]
