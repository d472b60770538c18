"""The sample ledger: which samples every optimizer step trained on, and their losses.

Each rank records, per micro-batch, the phase-index positions it trained on and each sample's loss.
At every checkpoint rank 0 gathers the records since the previous checkpoint and writes them as one
*segment*, ``<run dir>/ledger/<first step:08d>-<last step:08d>.parquet`` (columns :data:`COLUMNS`:
step, epoch, rank, micro-step, index position, source, shard, row in the shard, loss, and whether the sample
trained with its synthetic caption — ``phases.<p>.caption_mix``), before the
checkpoint's manifest, which lists the segments (name, rows, sha256) covering steps 1…its step. The
ledger of a checkpoint is exactly that list: a resume drops the segments it does not list (steps trained
after the checkpoint and lost with the process), so the ledger only ever holds steps that are in the
weights. Segments go to ``train.checkpoint_s3`` with their checkpoint (first), and come back with it.

:func:`audit` proves exactly-once per epoch against the epoch plans
(:func:`sdforge.latents.bucket_batches.plan_epoch`); the train stage puts its figures, the per-source
counts and the realised mix in its metrics, and the whole ledger in its output (``ledger.parquet``).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from sdforge.io import naming_write_faults

log = logging.getLogger(__name__)

LEDGER_DIR = "ledger"
COLUMNS = ("step", "epoch", "rank", "micro", "position", "source", "shard", "row", "loss", "synthetic")
_RAW = ("step", "epoch", "rank", "micro", "position", "loss", "synthetic")
_DTYPES = {"step": np.int32, "epoch": np.int32, "rank": np.int16, "micro": np.int16, "position": np.int32,
           "loss": np.float32, "synthetic": np.bool_}


class LedgerError(Exception):
    """A ledger segment is missing, or differs from what its checkpoint's manifest says."""


class LedgerBuffer:
    """One rank's records since the last checkpoint."""

    def __init__(self, rank: int):
        self.rank = rank
        self.parts: list[dict[str, np.ndarray]] = []

    def record(self, step: int, epoch: int, micro: int, positions: np.ndarray, losses, captions=None) -> None:
        """One micro-batch: its index positions and per-sample losses; ``captions`` (per index position, the
        epoch's :func:`sdforge.latents.loader.caption_choice`) says which trained with a synthetic caption."""
        n = len(positions)
        synthetic = np.zeros(n, bool) if captions is None else np.asarray(captions, bool)[np.asarray(positions)]
        self.parts.append({
            "step": np.full(n, step, np.int32), "epoch": np.full(n, epoch, np.int32),
            "rank": np.full(n, self.rank, np.int16), "micro": np.full(n, micro, np.int16),
            "position": np.asarray(positions, np.int32), "loss": np.asarray(losses, np.float32),
            "synthetic": synthetic,
        })

    def take(self) -> dict[str, np.ndarray]:
        """The buffered records as columns (emptied)."""
        parts, self.parts = self.parts, []
        return {k: np.concatenate([p[k] for p in parts]) if parts else np.empty(0, _DTYPES[k]) for k in _RAW}


def segment_name(first: int, last: int) -> str:
    return f"{first:08d}-{last:08d}.parquet"


def segment_range(name: str) -> tuple[int, int]:
    first, last = name.removesuffix(".parquet").split("-")
    return int(first), int(last)


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_segment(run_dir: Path, records: list[dict[str, np.ndarray]], data, first: int, last: int) -> dict:
    """Write the records of every rank (steps ``first``…``last``) as one segment; its manifest entry.

    ``data`` (:class:`sdforge.latents.loader.LatentIndexDataset`) names each position: source, shard, row.
    """
    cols = {k: np.concatenate([r[k] for r in records]) for k in _RAW}
    order = np.lexsort((cols["position"], cols["micro"], cols["rank"], cols["step"]))
    cols = {k: v[order] for k, v in cols.items()}
    pos = cols["position"]
    table = pa.table({
        "step": cols["step"], "epoch": cols["epoch"], "rank": cols["rank"], "micro": cols["micro"],
        "position": pos,
        "source": pa.DictionaryArray.from_arrays(pa.array(data.source_code[pos].astype(np.int32)),
                                                 pa.array(data.sources, pa.string())),
        "shard": data.shard[pos].astype(np.int64), "row": data.row[pos].astype(np.int64), "loss": cols["loss"],
        "synthetic": cols["synthetic"],
    })
    folder = run_dir / LEDGER_DIR
    folder.mkdir(parents=True, exist_ok=True)
    name = segment_name(first, last)
    tmp = folder / f".{name}.tmp"
    kept = "the previous checkpoint (if any) and its segments are intact: a rerun resumes from it"
    with naming_write_faults(folder / name, "the sample-ledger segment", setting="paths.runs", kept=kept):
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, folder / name)
    return {"name": name, "rows": table.num_rows, "sha256": _sha256(folder / name)}


def keep_only(run_dir: Path, entries: list[dict]) -> list[str]:
    """Delete the segments of ``run_dir`` not in ``entries`` (a checkpoint's list): steps lost after it."""
    folder = run_dir / LEDGER_DIR
    keep = {e["name"] for e in entries}
    dropped = sorted(p.name for p in folder.glob("*.parquet") if p.name not in keep) if folder.is_dir() else []
    for name in dropped:
        (folder / name).unlink()
    for tmp in folder.glob(".*.tmp") if folder.is_dir() else []:
        tmp.unlink()
    if dropped:
        log.info("ledger: dropped %d segment(s) past the resumed checkpoint: %s", len(dropped), ", ".join(dropped))
    return dropped


def read_ledger(run_dir: Path, entries: list[dict]) -> pa.Table:
    """The segments of ``entries``, checked against their rows and sha256, as one table (in step order)."""
    tables = []
    for entry in sorted(entries, key=lambda e: e["name"]):
        path = run_dir / LEDGER_DIR / entry["name"]
        if not path.is_file():
            raise LedgerError(f"{path}: missing (listed by the checkpoint's manifest)")
        if _sha256(path) != entry["sha256"]:
            raise LedgerError(f"{path}: does not match its sha256 in the checkpoint's manifest")
        table = pq.read_table(path)
        if table.num_rows != entry["rows"]:
            raise LedgerError(f"{path}: {table.num_rows} rows, the manifest says {entry['rows']}")
        tables.append(table)
    if not tables:
        return pa.table({c: [] for c in COLUMNS})
    return pa.concat_tables(tables, promote_options="permissive").combine_chunks()


def audit(ledger: pa.Table, plans: list, steps_done: list[int]) -> dict:
    """Exactly-once per epoch: ``plans[e]`` is epoch ``e``'s plan, ``steps_done[e]`` the steps of it trained.

    ``ledger.duplicates``: records of a sample seen again in its epoch; ``ledger.missing``: planned samples
    (of the trained steps) with no record; ``ledger.unplanned``: records no plan has; ``ledger.samples``.
    """
    epoch = ledger["epoch"].to_numpy() if ledger.num_rows else np.empty(0, np.int32)
    position = ledger["position"].to_numpy() if ledger.num_rows else np.empty(0, np.int32)
    duplicates = missing = unplanned = 0
    for e, (plan, done) in enumerate(zip(plans, steps_done, strict=True)):
        seen = position[epoch == e]
        unique = np.unique(seen)
        duplicates += len(seen) - len(unique)
        planned = np.concatenate(plan.batches[:done]) if done else np.empty(0, np.int64)
        missing += len(np.setdiff1d(planned, unique))
        unplanned += len(np.setdiff1d(unique, planned))
    unplanned += int(np.count_nonzero(epoch >= len(plans)))
    return {"ledger.samples": ledger.num_rows, "ledger.duplicates": int(duplicates),
            "ledger.missing": int(missing), "ledger.unplanned": int(unplanned)}


def source_summary(ledger: pa.Table, planned_share: dict[str, float]) -> dict:
    """Per source: samples trained, their mean loss, the realised share of the phase and the planned one."""
    out: dict[str, float | int] = {}
    total = ledger.num_rows
    if total == 0:
        return out
    sources = ledger["source"].cast(pa.string()).to_numpy(zero_copy_only=False)
    losses = ledger["loss"].to_numpy()
    for name in sorted(set(planned_share) | set(sources.tolist())):
        mask = sources == name
        n = int(mask.sum())
        out[f"source.{name}.samples"] = n
        out[f"source.{name}.share"] = round(n / total, 6)
        out[f"source.{name}.planned_share"] = round(planned_share.get(name, 0.0), 6)
        if n:
            out[f"source.{name}.mean_loss"] = round(float(losses[mask].mean()), 6)
    return out


def caption_summary(ledger: pa.Table, has_synthetic: np.ndarray, p_synthetic: float) -> dict:
    """Per source: samples trained with their synthetic and with their original caption, the realised synthetic
    share and the planned one (``p_synthetic`` × the share of its trained samples that have a synthetic caption;
    ``has_synthetic`` per index position)."""
    if ledger.num_rows == 0 or "synthetic" not in ledger.column_names:
        return {}
    sources = ledger["source"].cast(pa.string()).to_numpy(zero_copy_only=False)
    used = ledger["synthetic"].fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
    available = has_synthetic[ledger["position"].to_numpy()]
    out: dict[str, float | int] = {"caption.synthetic": int(used.sum()), "caption.original": int((~used).sum())}
    for name in sorted(set(sources.tolist())):
        mask = sources == name
        n = int(mask.sum())
        out[f"caption.{name}.synthetic"] = int(used[mask].sum())
        out[f"caption.{name}.original"] = n - int(used[mask].sum())
        out[f"caption.{name}.synthetic_share"] = round(float(used[mask].mean()), 6)
        out[f"caption.{name}.planned_synthetic_share"] = round(p_synthetic * float(available[mask].mean()), 6)
    return out
