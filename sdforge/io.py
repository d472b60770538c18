"""Helpers every stage module shares: the thin CLI, atomic writes, metrics JSON."""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import pickle
import re
import resource
import shutil
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

    On any exception the temp file (``.<name>.*.tmp``) is removed and ``path`` is left as it was; a write fault
    (full disk, file-size limit, read-only or forbidden folder) is an :class:`OutputError` naming ``path``
    (:func:`naming_write_faults`).
    """
    path = Path(path)
    with naming_write_faults(path, kept=f"{path.name} was not replaced (any previous version is intact)"):
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


def conditions_path(index_path: str | Path) -> Path:
    """A phase index's conditions record: ``<phase>.parquet`` → ``<phase>.conditions.json`` (``mix_phase``: the
    sha256 of every ``condition_images`` shard marker a ControlNet phase reads; the train stage's DVC dependency)."""
    return Path(index_path).with_suffix(".conditions.json")


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
    outputs. A :class:`ConfigError` or an :class:`InputError` (an :class:`OutputError` too) exits with the
    message (no traceback) and status 2; so does a disk fault that no writer named (:data:`DISK_FAULTS`, with the
    path the ``OSError`` carries).
    """
    setup_logging()
    try:
        params = load_params(params_file)
        if needs_item:
            _check_item(params, stage, item)
        metrics = run(params, item)
        write_json(metrics_path(params, stage, item), metrics)
    except (ConfigError, InputError) as err:
        log.error("%s", err)
        raise SystemExit(2) from None
    except Exception as err:
        # a writer without its own naming_write_faults: the path its OSError names, else the stage
        fault = write_fault(err, codes=DISK_FAULTS, unnamed=f"stage {stage}{f'@{item}' if item else ''}")
        if fault is None:
            raise
        log.error("%s", fault)
        raise SystemExit(2) from None
    log.info("%s%s done: %s", stage, f"@{item}" if item else "", metrics)
    return metrics


class InputError(ValueError):
    """Bad input data that the user must fix; the message names the file/row/key."""


# -- write faults ------------------------------------------------------------------------------
class OutputError(InputError):
    """An output that cannot be written (full disk, quota, file-size limit, read-only or forbidden folder); the
    message names the path, the cause and what to do. An :class:`InputError`, so every stage CLI and ``sdforge``
    print it as one line and exit with status 2."""


WRITE_FAULTS = {
    errno.ENOSPC: ("no space left on device", "ENOSPC"),
    errno.EDQUOT: ("disk quota exceeded", "EDQUOT"),
    errno.EFBIG: ("file too large", "EFBIG"),
    errno.EROFS: ("read-only file system", "EROFS"),
    errno.EACCES: ("permission denied", "EACCES"),
    errno.EPERM: ("operation not permitted", "EPERM"),
}
"""The errnos a writer turns into an :class:`OutputError`: ``errno → (what it means, its name)``."""
DISK_FAULTS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
"""Those that only a write raises (a read can fail with EACCES too): the stage CLI names them wherever they come
from, with the path the ``OSError`` carries."""
LOW_SPACE_BYTES = 2**20
"""A writer that failed without an errno (torch's zip writer) on a file system with less free space than this is
taken to have run out of space."""
_ERRNO_IN_TEXT = re.compile(r"(?:os error|errno)\s*(\d+)", re.IGNORECASE)
"""How Rust writers (safetensors, polars) and pyarrow carry the errno in their message: ``(os error 28)``."""
_FAULT_WORDING = {"database or disk is full": errno.ENOSPC}
"""Writers that word a fault their own way: SQLite (the MLflow store) on a full disk."""
_UNNAMED_WRITE_FAILURE = re.compile(r"iostream error|unexpected pos|failed writing|write failed", re.IGNORECASE)
"""torch's zip writer on a write fault by path: ``basic_ios::clear: iostream error``, ``unexpected pos …``."""


def fault_errno(err: BaseException, codes=WRITE_FAULTS) -> tuple[int, OSError | None] | None:
    """The write fault of ``codes`` that ``err`` is or wraps (its ``__cause__``/``__context__`` chain, or the errno
    or the OS's wording in its message), with the ``OSError`` that carried it (None when only a message did)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in codes:
            return current.errno, current
        text = str(current)
        numbers = (int(m.group(1)) for m in _ERRNO_IN_TEXT.finditer(text))
        code = next((n for n in numbers if n in codes), None)
        code = code or next((c for c in codes if os.strerror(c) in text), None)
        code = code or next((c for words, c in _FAULT_WORDING.items() if words in text and c in codes), None)
        if code is not None:
            return code, None
        current = current.__cause__ or current.__context__
    return None


def write_fault(
    err: BaseException,
    path: str | Path | None = None,
    what: str = "",
    *,
    setting: str = "",
    kept: str = "",
    codes=WRITE_FAULTS,
    unnamed: str = "",
) -> OutputError | None:
    """``err`` as an :class:`OutputError` when it is a write fault (:func:`fault_errno`), else None.

    The message: ``<path>: cannot write <what>: <cause> (<ERRNO>); <what to do>, then re-run; <kept>``.
    ``path`` defaults to the file the ``OSError`` names, then to ``unnamed`` (e.g. the stage; None without it);
    ``setting`` is the params key that points the output elsewhere; ``kept`` says what the failed write left
    intact. A writer that failed with no errno at all (torch's zip writer: ``basic_ios::clear: iostream error``)
    is diagnosed from ``path``'s file system: read-only, nearly full, a file-size limit in force, not writable.
    """
    found, how = fault_errno(err, codes), ""
    if found is None and path is not None and _UNNAMED_WRITE_FAILURE.search(str(err)):
        probed = _probe_write_fault(Path(path))  # no errno to go by: judge from the file system
        if probed in codes:
            found, how = (probed, None), ", found on the file system after the write failed"
    if found is None:
        return None
    code, oserror = found
    path = path if path is not None else getattr(oserror, "filename", None)
    if path is None and not unnamed:
        return None
    cause, name = WRITE_FAULTS[code]
    message = f"{path or unnamed}: cannot write{' ' + what if what else ''}: {cause} ({name}{how}); "
    message += f"{_remedy(code, Path(path) if path else None, setting)}, then re-run"
    return OutputError(message + (f"; {kept}" if kept else ""))


@contextlib.contextmanager
def naming_write_faults(path: str | Path, what: str = "", *, setting: str = "", kept: str = "") -> Iterator[None]:
    """Turn a write fault raised inside into an :class:`OutputError` naming ``path`` (:func:`write_fault`); any
    other error passes unchanged."""
    try:
        yield
    except InputError:  # already says what it is (an OutputError from a nested writer, a named bad input)
        raise
    except Exception as err:
        fault = write_fault(err, path, what, setting=setting, kept=kept)
        if fault is None:
            raise
        raise fault from err


def fresh_folder(folder: str | Path, what: str = "", *, setting: str = "") -> Path:
    """``folder`` emptied and created again: a stage's own output, replaced whole. A folder that cannot be written
    (read-only, forbidden, full) is one :class:`OutputError` line naming it before anything in it is removed —
    not ``rmtree(ignore_errors=True)`` failing silently and ``mkdir`` then saying "File exists"."""
    folder = Path(folder)
    require_writable(folder, what, setting=setting)
    with naming_write_faults(folder, what, setting=setting, kept="the folder may be partly emptied; re-run"):
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
    return folder


def require_writable(folder: str | Path, what: str = "", *, setting: str = "") -> None:
    """An :class:`OutputError` naming the cause unless a file can be created in ``folder`` (or, while it does not
    exist, in its nearest existing parent): checked before a stage clears or fills an output folder."""
    folder = Path(folder)
    with naming_write_faults(folder, what, setting=setting, kept="nothing was changed"):
        fd, probe = tempfile.mkstemp(prefix=".sdforge-write-check.", suffix=".tmp", dir=_existing(folder))
        os.close(fd)
        os.unlink(probe)


def _existing(path: Path) -> Path:
    """``path``'s nearest existing folder (itself when it is one)."""
    path = path.absolute()
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def _mount_point(path: Path) -> Path:
    path = _existing(path)
    while not os.path.ismount(path):
        path = path.parent
    return path


def _probe_write_fault(path: Path) -> int | None:
    """The likely errno of a write to ``path`` that failed without one, from its file system; None if none fits."""
    folder = _existing(path.parent if not path.is_dir() else path)
    try:
        fs = os.statvfs(folder)
    except OSError:
        return None
    if fs.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if fs.f_bavail * fs.f_frsize < LOW_SPACE_BYTES:
        return errno.ENOSPC
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        return errno.EFBIG
    if not os.access(folder, os.W_OK):
        return errno.EACCES
    return None


def _remedy(code: int, path: Path | None, setting: str) -> str:
    """What to do about write fault ``code`` at ``path`` (None: unknown, the outputs' disk)."""
    elsewhere = f"point {setting} elsewhere" if setting else "write the output elsewhere"
    mount = _mount_point(path) if path is not None else "the disk that holds the outputs"
    if code == errno.ENOSPC and path is not None:
        fs = os.statvfs(mount)
        return f"free space on {mount} ({_size(fs.f_bavail * fs.f_frsize)} free now) or {elsewhere}"
    if code == errno.ENOSPC:
        return f"free space on {mount} or {elsewhere}"
    if code == errno.EDQUOT:
        return f"free space within your quota on {mount}, raise the quota, or {elsewhere}"
    if code == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            return f"raise the file-size limit (`ulimit -f`; {_size(limit)} now) or {elsewhere}"
        return f"use a file system that allows larger files than the one at {mount}, or {elsewhere}"
    if code == errno.EROFS:
        return f"{mount} is mounted read-only: remount it read-write or {elsewhere}"
    folder = _existing(path.parent) if path is not None else "the output folder"
    return f"let user {os.geteuid()} write to {folder} or {elsewhere}"


def _size(n: float) -> str:
    units = ("bytes", "KiB", "MiB", "GiB", "TiB")
    power = 0
    while n >= 1024 and power < len(units) - 1:
        n, power = n / 1024, power + 1
    return f"{n:.0f} bytes" if power == 0 else f"{n:.1f} {units[power]}"


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
