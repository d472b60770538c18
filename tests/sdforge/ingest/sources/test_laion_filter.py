"""The LAION filter's row counts (issue 55, item 2): every pass counts the file's rows, for any subset of the
optional columns, any rule switches and any row-group layout; a file edited between the passes is still caught."""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sdforge.config import Columns, FilterRules
from sdforge.ingest.sources.laion import filter as laion_filter
from sdforge.io import InputError

COLUMNS = Columns()
THRESHOLDS = {
    "aesthetic": ("min_aesthetic", 5.0),
    "similarity": ("min_similarity", 0.28),
    "width": ("min_width", 32),
    "height": ("min_height", 32),
    "pwatermark": ("max_pwatermark", 0.5),
    "punsafe": ("max_punsafe", 0.5),
}
OPTIONAL = (*THRESHOLDS, "hash")
FLOATS = [None, math.nan, -1.0, 0.0, 0.2, 0.3, 0.6, 6.0, math.inf]
INTS = [None, -1, 0, 31, 32, 64]
URLS = ["http://e.com/0", "http://E.com/0", "http://e.com/1", " http://e.com/1 ", "https://e.com/2", "", None]
HASHES = [None, 1, 2, 3]
_URL_HEAD = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*://[^/?#]*)")


def write_parquet(path: Path, rows: list[dict], names: list[str], row_group_size: int) -> None:
    """``rows`` (only the ``names`` columns, typed even when empty) as parquet, ``row_group_size`` rows a group."""
    schema = {COLUMNS.url: pl.String, COLUMNS.caption: pl.String}
    for name in names:
        schema[getattr(COLUMNS, name)] = pl.Int64 if name in ("width", "height", "hash") else pl.Float64
    frame = pl.DataFrame([{col: row[col] for col in schema} for row in rows], schema=schema)
    pq.write_table(frame.to_arrow(), path, row_group_size=row_group_size)


def passes(value: float | None, op: str, threshold: float) -> bool:
    """The documented rule: null, NaN, ±inf and negative values fail; else ``x ≥ min`` or ``x < max``."""
    if value is None or math.isnan(value) or math.isinf(value) or value < 0:
        return False
    return value >= threshold if op == "min" else value < threshold


def url_key(url: str | None) -> str | None:
    """The URL stripped, its scheme and host lower-cased; None for a null or empty URL."""
    if not url or not url.strip():
        return None
    url = url.strip()
    head = _URL_HEAD.match(url)
    return head.group(1).lower() + url[head.end() :] if head else url


def reference(rows: list[dict], rules: FilterRules) -> tuple[dict, list[str]]:
    """Plain-python filter: the drop counts per rule, rows_in/rows_out, and the kept rows' captions in order."""
    checks = [(name, *THRESHOLDS[name]) for name in THRESHOLDS if getattr(rules, THRESHOLDS[name][0]) is not None]
    dropped = dict.fromkeys(laion_filter.LAION_RULES, 0)
    seen_urls, seen_hashes, kept = set(), set(), []
    for row in rows:
        failed = next(
            (name for name, key, t in checks if not passes(row[getattr(COLUMNS, name)], key.split("_")[0], t)), None
        )
        if failed:
            dropped[failed] += 1
            continue
        key = url_key(row[COLUMNS.url])
        if rules.dedup_url and (key is None or key in seen_urls):
            dropped["duplicate_url"] += 1
            continue
        seen_urls.add(key)
        if rules.dedup_hash and (row[COLUMNS.hash] is None or row[COLUMNS.hash] in seen_hashes):
            dropped["duplicate_hash"] += 1
            continue
        seen_hashes.add(row[COLUMNS.hash])
        kept.append(row[COLUMNS.caption])
    counts = {"rows_in": len(rows), "rows_out": len(kept)} | {f"dropped_{k}": v for k, v in dropped.items()}
    return counts, kept


def row_strategy():
    """One metadata row with every column (the file written keeps only some)."""
    values = {getattr(COLUMNS, name): st.sampled_from(FLOATS) for name in ("aesthetic", "similarity")}
    values |= {getattr(COLUMNS, name): st.sampled_from(FLOATS) for name in ("pwatermark", "punsafe")}
    values |= {getattr(COLUMNS, name): st.sampled_from(INTS) for name in ("width", "height")}
    values |= {COLUMNS.url: st.sampled_from(URLS), COLUMNS.hash: st.sampled_from(HASHES)}
    return st.fixed_dictionaries(values)


@st.composite
def filter_cases(draw):
    """(present optional columns, rules that only read present columns, files' rows, row-group size)."""
    present = sorted(draw(st.sets(st.sampled_from(OPTIONAL))))
    rules = {key: value for name, (key, value) in THRESHOLDS.items() if name in present and draw(st.booleans())}
    rules |= {key: None for name, (key, _) in THRESHOLDS.items() if key not in rules}
    rules["dedup_url"] = draw(st.booleans())
    rules["dedup_hash"] = "hash" in present and draw(st.booleans())
    files = draw(st.lists(st.lists(row_strategy(), max_size=8), min_size=1, max_size=3))
    for i, row in enumerate(row for rows in files for row in rows):
        row[COLUMNS.caption] = f"row {i}"
    return present, FilterRules(**rules), files, draw(st.sampled_from([1, 2, 3, 1000]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(filter_cases())
def test_counts_equal_a_plain_python_filter_for_any_columns_rules_and_row_groups(case):
    present, rules, files, row_group_size = case
    with tempfile.TemporaryDirectory() as tmp:
        meta = Path(tmp) / "meta"
        meta.mkdir()
        for i, rows in enumerate(files):
            write_parquet(meta / f"part-{i}.parquet", rows, present, row_group_size)
        metrics, _ = laion_filter.filter_laion(meta, Path(tmp) / "filtered.parquet", COLUMNS, rules)
        kept = pl.read_parquet(Path(tmp) / "filtered.parquet")["caption"].to_list()
    expected, expected_kept = reference([row for rows in files for row in rows], rules)
    assert {key: metrics[key] for key in expected} == expected
    assert kept == expected_kept


def test_a_file_with_only_url_and_caption_in_one_row_groups_counts_every_row(tmp_path):
    meta = tmp_path / "meta"
    meta.mkdir()
    rows = [{COLUMNS.url: f"http://e.com/{i}", COLUMNS.caption: f"row {i}"} for i in range(300)]
    write_parquet(meta / "part-0.parquet", rows, [], row_group_size=1)
    rules = FilterRules(dedup_url=False, dedup_hash=False)
    metrics, hist = laion_filter.filter_laion(meta, tmp_path / "filtered.parquet", COLUMNS, rules)
    assert (metrics["rows_in"], metrics["rows_out"]) == (300, 300)
    assert pl.read_parquet(tmp_path / "filtered.parquet")["caption"].to_list() == [f"row {i}" for i in range(300)]
    assert sum(hist.before["aesthetic"]) == 0  # no aesthetic column: no row has a bin


def test_a_file_rewritten_between_the_passes_is_the_changed_while_filtered_error(tmp_path, monkeypatch):
    meta = tmp_path / "meta"
    meta.mkdir()
    rows = [{COLUMNS.url: f"http://e.com/{i}", COLUMNS.caption: f"row {i}", COLUMNS.hash: i} for i in range(4)]
    write_parquet(meta / "part-0.parquet", rows, ["hash"], row_group_size=1000)
    first_pass = laion_filter.rule_counts

    def rule_counts_then_edit(files, rules):
        counts = first_pass(files, rules)
        write_parquet(meta / "part-0.parquet", rows + rows[:1], ["hash"], row_group_size=1000)
        return counts

    monkeypatch.setattr(laion_filter, "rule_counts", rule_counts_then_edit)
    rules = FilterRules(dedup_url=False)
    with pytest.raises(InputError, match=r"meta: the metadata files changed while being filtered; run the stage again"):
        laion_filter.filter_laion(meta, tmp_path / "filtered.parquet", COLUMNS, rules)
