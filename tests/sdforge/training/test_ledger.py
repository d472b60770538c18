"""The sample ledger: segments named by their steps, checked against the manifest, trimmed on resume, audited
against the epoch plans (exactly-once), summarised per source."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from sdforge.latents.bucket_batches import BatchSplit, plan_epoch
from sdforge.training.ledger import (
    LedgerBuffer,
    LedgerError,
    audit,
    keep_only,
    read_ledger,
    source_summary,
    write_segment,
)

DATA = SimpleNamespace(
    sources=["coco", "laion"], source_code=np.array([0, 1] * 16), shard=np.arange(32) // 8, row=np.arange(32) % 8
)
SPLIT = BatchSplit(micro=4, accum=1, world=2)


def _record(steps: range, plans, world: int = 2) -> list[LedgerBuffer]:
    """What ``world`` ranks record for ``steps`` (1-based, 4 steps per epoch)."""
    buffers = [LedgerBuffer(r) for r in range(world)]
    for step in steps:
        epoch, index = divmod(step - 1, 4)
        for r, buf in enumerate(buffers):
            part = plans[epoch].batches[index][SPLIT.part(0, r)]
            buf.record(step, epoch, 0, part, np.full(len(part), 0.5 + r))
    return buffers


def test_segments_round_trip_and_the_audit_proves_exactly_once(tmp_path: Path):
    plans = [plan_epoch(np.zeros(32, np.int32), e, 3, 8) for e in range(2)]
    entries = []
    for first, last in ((1, 3), (4, 6), (7, 8)):
        entries.append(write_segment(tmp_path, [b.take() for b in _record(range(first, last + 1), plans)], DATA,
                                     first, last))
    assert [e["name"] for e in entries] == ["00000001-00000003.parquet", "00000004-00000006.parquet",
                                            "00000007-00000008.parquet"]
    ledger = read_ledger(tmp_path, entries)
    assert ledger.num_rows == 64 and ledger["step"].to_pylist() == sorted(ledger["step"].to_pylist())
    assert audit(ledger, plans, [4, 4]) == {"ledger.samples": 64, "ledger.duplicates": 0, "ledger.missing": 0,
                                            "ledger.unplanned": 0}
    summary = source_summary(ledger, {"laion": 0.5, "coco": 0.5})
    assert summary["source.laion.samples"] + summary["source.coco.samples"] == 64
    assert summary["source.laion.share"] == pytest.approx(summary["source.laion.samples"] / 64)
    row = ledger.slice(0, 1).to_pylist()[0]
    assert (row["source"], row["shard"], row["row"]) == (DATA.sources[DATA.source_code[row["position"]]],
                                                        DATA.shard[row["position"]], DATA.row[row["position"]])


def test_a_repeated_or_skipped_step_is_counted(tmp_path: Path):
    plans = [plan_epoch(np.zeros(32, np.int32), e, 3, 8) for e in range(2)]
    repeated = write_segment(tmp_path, [b.take() for b in _record([1, 2, 2, 3, 4], plans)], DATA, 1, 4)
    figures = audit(read_ledger(tmp_path, [repeated]), plans[:1], [4])
    assert (figures["ledger.duplicates"], figures["ledger.missing"]) == (8, 0)
    skipped = write_segment(tmp_path, [b.take() for b in _record([1, 3, 4], plans)], DATA, 1, 4)
    figures = audit(read_ledger(tmp_path, [skipped]), plans[:1], [4])
    assert (figures["ledger.duplicates"], figures["ledger.missing"]) == (0, 8)


def test_resume_drops_segments_its_checkpoint_does_not_list_and_a_changed_segment_is_an_error(tmp_path: Path):
    plans = [plan_epoch(np.zeros(32, np.int32), e, 3, 8) for e in range(2)]
    first = write_segment(tmp_path, [b.take() for b in _record(range(1, 3), plans)], DATA, 1, 2)
    write_segment(tmp_path, [b.take() for b in _record(range(3, 5), plans)], DATA, 3, 4)  # lost with the process
    assert keep_only(tmp_path, [first]) == ["00000003-00000004.parquet"]
    assert sorted(p.name for p in (tmp_path / "ledger").iterdir()) == [first["name"]]
    (tmp_path / "ledger" / first["name"]).write_bytes(b"not parquet")
    with pytest.raises(LedgerError, match="sha256"):
        read_ledger(tmp_path, [first])


def test_resume_removes_a_killed_writes_temp_segment_and_nothing_but_segments(tmp_path: Path):
    """``keep_only`` deletes only the ledger's own files: unlisted ``*.parquet`` segments and ``.*.tmp`` temps."""
    plans = [plan_epoch(np.zeros(32, np.int32), e, 3, 8) for e in range(2)]
    first = write_segment(tmp_path, [b.take() for b in _record(range(1, 3), plans)], DATA, 1, 2)
    (tmp_path / "ledger" / ".00000003-00000004.parquet.tmp").write_bytes(b"half a segment")  # a killed write
    (tmp_path / "ledger" / "notes.txt").write_text("not the ledger's")
    assert keep_only(tmp_path, [first]) == []
    assert sorted(p.name for p in (tmp_path / "ledger").iterdir()) == [first["name"], "notes.txt"]
