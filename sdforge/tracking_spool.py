"""The MLflow records of short stages, spooled to disk and replayed later (``tracking.spool``).

A stage process that opens MLflow pays ~4 s before its first record on a 2-core machine (``import mlflow``
~1.6 s, the SQLite store's SQLAlchemy ~1.5 s, the experiment lookup): more than most data and mix stages
spend on their work (``bench.stage_startup``; the demo runs ~30 of them). So a stage that logs only what it
has at its end (:func:`sdforge.tracking.stage_run` with ``deferrable=True``) records its calls here instead:
one folder per run under ``<sqlite file>.spool/`` with ``entry.json`` (parent, stage, params, the calls in
order) and the files it logged. The next process that opens MLflow anyway (``train``, a sampled
``eval_grid``, ``report``, the flows' run links, ``tools.results``, ``sdforge tracking-flush``) replays them
first, oldest first, into the same runs a direct log would have made (:func:`sdforge.tracking.flush_spool`).

Only with a local SQLite store: with a tracking server (``MLFLOW_TRACKING_URI=http://…``, the cluster) every
stage logs directly, since a pod's spool would never be seen by another pod. Nothing here imports mlflow.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from sdforge.io import naming_write_faults

SPOOL_SUFFIX = ".spool"
SQLITE_PREFIX = "sqlite:///"
ENTRY = "entry.json"
FAILED = "failed"
"""Entries whose replay raised are moved here (with a warning), never deleted."""


def spool_dir(uri: str) -> Path | None:
    """The spool folder of a local SQLite tracking URI (``<file>.spool`` beside it), else None."""
    if not uri.startswith(SQLITE_PREFIX):
        return None
    db = uri.removeprefix(SQLITE_PREFIX)
    return Path(db + SPOOL_SUFFIX) if db and db != ":memory:" else None


def pending(folder: Path) -> list[Path]:
    """The spooled runs in ``folder``, oldest first (fully written ones only: not a ``.<name>.tmp`` folder that a
    write fault left half-written)."""
    if not folder.is_dir():
        return []
    return sorted(
        p for p in folder.iterdir()
        if p.is_dir() and (p / ENTRY).is_file() and p.name != FAILED and not p.name.startswith(".")
    )  # fmt: skip


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s lock: one process replays at a time, so no run is replayed twice."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def set_aside(entry: Path) -> Path:
    """Move a run whose replay failed to ``failed/`` (kept for a look, never deleted); its new path."""
    target = entry.parent / FAILED / entry.name
    target.parent.mkdir(exist_ok=True)
    entry.rename(target)
    return target


class SpooledRun:
    """Stands in for the ``mlflow`` module in a deferred stage run: each logging call the stages make is
    recorded, and :meth:`write` puts the run in the spool. ``active_run()`` is None (nothing is live);
    :func:`sdforge.tracking.summarise` records its call through :meth:`record_summary`."""

    def __init__(self, parent: str, stage: str, params: dict[str, str], parent_params: dict[str, str]):
        self.entry: dict[str, Any] = {
            "parent": parent, "stage": stage, "params": params, "parent_params": parent_params,
            "recorded_ms": int(time.time() * 1000), "status": "FINISHED", "calls": [],
            "source": os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else "",
        }  # fmt: skip
        self.files: list[bytes] = []

    def _call(self, name: str, **kwargs: Any) -> None:
        self.entry["calls"].append({"call": name, **kwargs})

    def _file(self, data: bytes) -> str:
        self.files.append(data)
        return f"files/{len(self.files) - 1:04d}"

    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        """Record one metric."""
        self.log_metrics({key: value}, step=step)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Record metrics (at ``step``)."""
        self._call("log_metrics", metrics={k: float(v) for k, v in metrics.items()}, step=step)

    def log_param(self, key: str, value: Any) -> None:
        """Record one param."""
        self.log_params({key: value})

    def log_params(self, params: dict[str, Any]) -> None:
        """Record params (as strings, as MLflow keeps them)."""
        self._call("log_params", params={k: str(v) for k, v in params.items()})

    def set_tag(self, key: str, value: Any) -> None:
        """Record one tag."""
        self.set_tags({key: value})

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Record tags."""
        self._call("set_tags", tags={k: str(v) for k, v in tags.items()})

    def log_text(self, text: str, artifact_file: str) -> None:
        """Record a text artifact."""
        self._call("artifact", file=self._file(text.encode()), artifact_file=artifact_file)

    def log_dict(self, dictionary: dict, artifact_file: str) -> None:
        """Record a dict as a JSON artifact (as ``mlflow.log_dict`` writes a ``.json`` file)."""
        self.log_text(json.dumps(dictionary, indent=2), artifact_file)

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        """Record a matplotlib figure as a PNG artifact."""
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
        self._call("artifact", file=self._file(buffer.getvalue()), artifact_file=artifact_file)

    def log_image(self, image: Any, artifact_file: str) -> None:
        """Record a PIL image as a PNG artifact."""
        buffer = io.BytesIO()
        image.save(buffer, format="png")
        self._call("artifact", file=self._file(buffer.getvalue()), artifact_file=artifact_file)

    def log_artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        """Record a file as an artifact (its bytes now: the file may change before the replay)."""
        name = Path(local_path).name
        target = f"{artifact_path.rstrip('/')}/{name}" if artifact_path else name
        self._call("artifact", file=self._file(Path(local_path).read_bytes()), artifact_file=target)

    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        """Record every file under a folder as artifacts under ``artifact_path``."""
        for file, artifact_dir in files_under(Path(local_dir), artifact_path):
            self.log_artifact(file, artifact_dir or None)

    def record_summary(
        self,
        metrics: dict[str, float] | None,
        note: str | None,
        artifacts: Iterable[tuple[Path, str | None]],
        step: int,
    ) -> None:
        """Record a :func:`sdforge.tracking.summarise` call (its artifacts' bytes now)."""
        files = [
            {"file": self._file(file.read_bytes()), "name": file.name, "dir": artifact_dir}
            for path, artifact_path in artifacts
            for file, artifact_dir in files_under(Path(path), artifact_path)
        ]
        metrics = {k: float(v) for k, v in (metrics or {}).items()}
        self._call("summarise", metrics=metrics, note=note, files=files, step=step)

    def active_run(self) -> None:
        """No MLflow run is live while a deferred stage runs."""
        return None

    def failed(self) -> None:
        """Mark the run FAILED (the stage raised), as a direct run would end."""
        self.entry["status"] = "FAILED"

    def write(self, folder: Path) -> Path:
        """Put the run in the spool: written under a temporary name, then renamed (never half-seen). A write fault
        is an :class:`~sdforge.io.OutputError` naming the spool folder (the stage's own outputs are written)."""
        name = f"{time.time_ns():020d}-{os.getpid()}"
        tmp = folder / f".{name}.tmp"
        kept = "the stage's outputs are written; only its MLflow record is missing until a rerun"
        with naming_write_faults(folder, "the spooled MLflow run", setting="tracking.mlflow_uri", kept=kept):
            folder.mkdir(parents=True, exist_ok=True)
            (tmp / "files").mkdir(parents=True)
            for i, data in enumerate(self.files):
                (tmp / "files" / f"{i:04d}").write_bytes(data)
            (tmp / ENTRY).write_text(json.dumps(self.entry, indent=1, default=str))
            tmp.rename(folder / name)
        return folder / name


def files_under(path: Path, artifact_path: str | None) -> list[tuple[Path, str]]:
    """``(file, artifact dir)`` for a file (under ``artifact_path``) or every file under a folder (its sub-folders
    under ``artifact_path``), as MLflow's ``log_artifact(s)`` place them; ``""``: the run's root."""
    if not path.is_dir():
        return [(path, artifact_path or "")]
    out = []
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        parts = [part for part in (artifact_path, file.relative_to(path).parent.as_posix()) if part and part != "."]
        out.append((file, "/".join(parts)))
    return out


def staged_files(entry: Path, files: list[dict], tmp: Path) -> list[tuple[Path, str | None]]:
    """A spooled summary's files copied under ``tmp`` with their names: ``(file, artifact dir)`` pairs."""
    out = []
    for i, spec in enumerate(files):
        target = tmp / f"{i:04d}" / spec["name"]
        target.parent.mkdir(parents=True)
        shutil.copyfile(entry / spec["file"], target)
        out.append((target, spec["dir"] or None))
    return out
