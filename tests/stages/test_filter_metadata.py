"""filter_metadata: per-rule drop counts on the demo, null/NaN, rule order, URL normalisation, diffusiondb."""

from __future__ import annotations

import math
from pathlib import Path

import polars as pl
import pytest

from stages import filter_metadata
from stages.common import InputError
from stages.config import Columns, FilterRules, Source

RULES = FilterRules(
    min_aesthetic=5.0,
    min_similarity=0.28,
    min_width=32,
    min_height=32,
    max_pwatermark=0.5,
    max_punsafe=0.5,
)
GOOD = {
    "URL": "http://example.com/x.jpg",
    "TEXT": "a caption",
    "WIDTH": 64,
    "HEIGHT": 64,
    "similarity": 0.35,
    "punsafe": 0.01,
    "pwatermark": 0.1,
    "AESTHETIC_SCORE": 6.0,
    "hash": 1,
}


def laion_rows(*changes: dict) -> list[dict]:
    """Good rows with unique URL/hash, each updated with one ``changes`` dict."""
    rows = []
    for i, change in enumerate(changes):
        rows.append({**GOOD, "URL": f"http://example.com/{i}.jpg", "hash": 1000 + i, **change})
    return rows


def filter_rows(tmp_path: Path, rows: list[dict], rules: FilterRules = RULES, columns: Columns | None = None):
    """Write ``rows`` as one parquet file, filter it; return (metrics, kept dataframe)."""
    meta = tmp_path / "meta"
    meta.mkdir(exist_ok=True)
    pl.DataFrame(rows).write_parquet(meta / "part-0.parquet")
    source = Source(kind="laion", repo="unused", columns=columns or Columns(), filter=rules)
    metrics = filter_metadata.run(source, "laion", meta, tmp_path / "filtered")
    return metrics, pl.read_parquet(tmp_path / "filtered" / "filtered.parquet")


def test_demo_drop_counts_equal_the_injected_rows(demo_params, run_until, tree_digest):
    metrics = run_until(demo_params, "filter_metadata")
    made, demo = metrics["make_demo_data"], demo_params.demo
    assert metrics["filter_metadata@laion"] == {
        "files": 1,
        "rows_in": made["laion_rows_total"],
        "dropped_aesthetic": demo.low_aesthetic_rows,
        "dropped_similarity": 0,
        "dropped_width": demo.small_rows,
        "dropped_height": 0,
        "dropped_pwatermark": demo.watermark_rows,
        "dropped_punsafe": demo.nsfw_rows,
        "dropped_duplicate_url": made["duplicate_url_rows"],
        "dropped_duplicate_hash": made["duplicate_hash_rows"],
        "rows_out": demo.laion_rows + demo.missing_rows,
    }
    out = Path(demo_params.paths.filtered) / "laion"
    df = pl.read_parquet(out / "filtered.parquet")
    assert df.columns == [
        "url",
        "caption",
        "width",
        "height",
        "similarity",
        "punsafe",
        "pwatermark",
        "aesthetic",
        "hash",
    ]
    assert df.height == demo.laion_rows + demo.missing_rows
    assert df["url"].n_unique() == df.height and df["hash"].n_unique() == df.height
    assert (df["aesthetic"] >= 5).all() and (df["width"] == demo.image_size).all()
    digest = tree_digest(out)
    source = demo_params.sources["laion"]
    filter_metadata.run(source, "laion", Path(demo_params.paths.metadata) / "laion", out)
    assert tree_digest(out) == digest


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ({"AESTHETIC_SCORE": None}, "aesthetic"),
        ({"AESTHETIC_SCORE": math.nan}, "aesthetic"),
        ({"AESTHETIC_SCORE": 4.99}, "aesthetic"),
        ({"similarity": math.nan}, "similarity"),
        ({"similarity": 0.2}, "similarity"),
        ({"WIDTH": None}, "width"),
        ({"WIDTH": 31}, "width"),
        ({"HEIGHT": 16}, "height"),
        ({"pwatermark": 0.5}, "pwatermark"),
        ({"pwatermark": math.nan}, "pwatermark"),
        ({"punsafe": 0.9}, "punsafe"),
        ({"punsafe": None}, "punsafe"),
        ({"URL": None}, "duplicate_url"),
        ({"hash": None}, "duplicate_hash"),
    ],
)
def test_bad_or_missing_value_fails_its_rule(tmp_path, change, rule):
    metrics, kept = filter_rows(tmp_path, laion_rows({}, change, {}))
    assert metrics[f"dropped_{rule}"] == 1
    assert metrics["rows_in"] == 3 and metrics["rows_out"] == 2
    assert sum(v for k, v in metrics.items() if k.startswith("dropped_")) == 1
    assert kept["url"].to_list() == ["http://example.com/0.jpg", "http://example.com/2.jpg"]


def test_a_row_counts_under_the_first_rule_it_fails(tmp_path):
    rows = laion_rows(
        {"pwatermark": 0.9, "AESTHETIC_SCORE": 1.0, "HEIGHT": 8},
        {"pwatermark": 0.9, "punsafe": 0.9, "HEIGHT": 8},
        {"pwatermark": 0.9, "punsafe": 0.9},
    )
    metrics, _ = filter_rows(tmp_path, rows)
    assert (metrics["dropped_aesthetic"], metrics["dropped_height"], metrics["dropped_pwatermark"]) == (1, 1, 1)
    assert metrics["dropped_punsafe"] == 0 and metrics["rows_out"] == 0


def test_rules_set_to_none_are_off(tmp_path):
    rows = laion_rows({"AESTHETIC_SCORE": None, "WIDTH": 1, "punsafe": math.nan}, {"URL": "http://example.com/0.jpg"})
    rules = FilterRules(min_aesthetic=None, min_width=None, max_punsafe=None, dedup_url=False, dedup_hash=False)
    metrics, kept = filter_rows(tmp_path, rows, rules)
    assert metrics["rows_out"] == 2
    assert all(v == 0 for k, v in metrics.items() if k.startswith("dropped_"))
    assert kept["width"].to_list() == [1, 64]


def test_url_dedup_normalises_scheme_host_and_spaces_and_keeps_the_first(tmp_path):
    rows = laion_rows(
        {"URL": "http://Example.com/A.jpg", "TEXT": "first"},
        {"URL": "  HTTP://EXAMPLE.COM/A.jpg ", "TEXT": "same url"},
        {"URL": "http://example.com/a.jpg", "TEXT": "path case differs"},
        {"AESTHETIC_SCORE": 1.0, "URL": "http://example.com/B.jpg", "TEXT": "dropped earlier"},
        {"URL": "http://example.com/B.jpg", "TEXT": "first kept B"},
    )
    metrics, kept = filter_rows(tmp_path, rows)
    assert metrics["dropped_duplicate_url"] == 1 and metrics["dropped_aesthetic"] == 1
    assert kept["caption"].to_list() == ["first", "path case differs", "first kept B"]
    assert kept["url"].to_list()[0] == "http://Example.com/A.jpg"


def test_hash_dedup_keeps_the_first_in_file_order(tmp_path):
    meta = tmp_path / "meta"
    (meta / "b").mkdir(parents=True)
    pl.DataFrame(laion_rows({"hash": 7, "TEXT": "second file"})).write_parquet(meta / "b" / "part.parquet")
    pl.DataFrame(laion_rows({}, {}, {"hash": 7, "TEXT": "first file"})).write_parquet(meta / "a.parquet")
    source = Source(kind="laion", repo="unused", filter=RULES.model_copy(update={"dedup_url": False}))
    metrics = filter_metadata.run(source, "laion", meta, tmp_path / "out")
    kept = pl.read_parquet(tmp_path / "out" / "filtered.parquet")
    assert (metrics["files"], metrics["rows_in"], metrics["dropped_duplicate_hash"], metrics["rows_out"]) == (
        2,
        4,
        1,
        3,
    )
    assert kept.filter(pl.col("hash") == 7)["caption"].to_list() == ["first file"]


def test_configured_column_names(tmp_path):
    rows = [{"link": r["URL"], "caption_text": r["TEXT"], "aes": r["AESTHETIC_SCORE"]} for r in laion_rows({}, {})]
    rows[1]["aes"] = 2.0
    columns = Columns(url="link", caption="caption_text", aesthetic="aes")
    rules = FilterRules(min_aesthetic=5.0, dedup_hash=False)
    metrics, kept = filter_rows(tmp_path, rows, rules, columns)
    assert (metrics["dropped_aesthetic"], metrics["rows_out"]) == (1, 1)
    assert kept["url"].to_list() == ["http://example.com/0.jpg"] and kept["hash"].null_count() == 1


def test_a_missing_column_that_a_rule_needs_is_named(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "pwatermark"} for r in laion_rows({})]
    with pytest.raises(InputError, match=r"'pwatermark' \(columns.pwatermark\) not found"):
        filter_rows(tmp_path, rows)


def test_mlflow_gets_metrics_and_the_metrics_json(tmp_path):
    import mlflow

    from stages.config import Tracking

    meta = tmp_path / "meta"
    meta.mkdir()
    pl.DataFrame(laion_rows({}, {"AESTHETIC_SCORE": 1.0})).write_parquet(meta / "p.parquet")
    tracking = Tracking(mlflow_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="test-filter")
    source = Source(kind="laion", repo="unused", filter=RULES)
    metrics = filter_metadata.run(source, "laion", meta, tmp_path / "out", tracking=tracking)
    mlflow.set_tracking_uri(tracking.mlflow_uri)
    runs = mlflow.search_runs(
        experiment_names=["test-filter"], filter_string="tags.`sdforge.stage` = 'filter_metadata@laion'"
    )
    assert len(runs) == 1
    assert runs["metrics.rows_out"][0] == 1 and runs["metrics.dropped_aesthetic"][0] == 1
    run_id = runs["run_id"][0]
    logged = mlflow.artifacts.load_dict(f"runs:/{run_id}/filter_metadata/laion.json")
    assert logged == metrics
