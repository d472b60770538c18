"""filter_metadata: per-rule drop counts on the demo, null/NaN, rule order, URL normalisation, diffusiondb."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

import polars as pl
import pytest

from sdforge.config import Columns, FilterRules, Source
from sdforge.ingest.sources.laion import dedup as laion_dedup
from sdforge.ingest.sources.laion import filter as laion_filter
from sdforge.io import InputError
from sdforge.tracking import flush_spool
from stages import filter_metadata

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
        "captions_truncated": 0,
        "urls_credentials_redacted": 0,
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
        "caption_truncated",
    ]
    assert df.height == demo.laion_rows + demo.missing_rows
    assert df["url"].n_unique() == df.height and df["hash"].n_unique() == df.height
    assert (df["aesthetic"] >= 5).all() and set(zip(df["width"], df["height"], strict=True)) <= set(demo.canvas_sizes)
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


def test_mlflow_gets_metrics_the_metrics_json_and_the_histograms(tmp_path):
    import mlflow

    from sdforge.config import Tracking

    meta = tmp_path / "meta"
    meta.mkdir()
    pl.DataFrame(laion_rows({}, {"AESTHETIC_SCORE": 1.0})).write_parquet(meta / "p.parquet")
    tracking = Tracking(mlflow_uri=f"sqlite:///{tmp_path}/mlflow.db", experiment="test-filter")
    source = Source(kind="laion", repo="unused", filter=RULES)
    metrics, hist = filter_metadata.filter_with_histograms(source, "laion", meta, tmp_path / "out")
    filter_metadata.log_to_mlflow(tracking, "laion", source, metrics, hist)
    assert flush_spool(tracking) == 1  # a short stage's run is spooled (tracking.spool), then replayed
    mlflow.set_tracking_uri(tracking.mlflow_uri)
    runs = mlflow.search_runs(
        experiment_names=["test-filter"], filter_string="tags.`sdforge.stage` = 'filter_metadata@laion'"
    )
    assert len(runs) == 1
    assert runs["metrics.rows_out"][0] == 1 and runs["metrics.dropped_aesthetic"][0] == 1
    run_id = runs["run_id"][0]
    logged = mlflow.artifacts.load_dict(f"runs:/{run_id}/filter_metadata/laion.json")
    assert logged == metrics
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(run_id, "filter_metadata")}
    assert artifacts == {
        f"filter_metadata/laion{suffix}" for suffix in (".json", "_histograms.json", "_histograms.png")
    }
    hist = mlflow.artifacts.load_dict(f"runs:/{run_id}/filter_metadata/laion_histograms.json")
    assert [sum(hist["before"]["aesthetic"]), sum(hist["after"]["aesthetic"])] == [2, 1]
    assert hist["after"]["aesthetic"][60] == 1 and hist["before"]["aesthetic"][10] == 1
    png = mlflow.artifacts.download_artifacts(f"runs:/{run_id}/filter_metadata/laion_histograms.png", dst_path=tmp_path)
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- bad metadata values ------------------------------------------------------------------------------

PERMISSIVE = FilterRules(
    min_aesthetic=-5.0,
    min_similarity=-1.0,
    min_width=0,
    min_height=0,
    max_pwatermark=0.5,
    max_punsafe=0.5,
)


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ({"AESTHETIC_SCORE": -0.5}, "aesthetic"),
        ({"AESTHETIC_SCORE": math.inf}, "aesthetic"),
        ({"similarity": -0.1}, "similarity"),
        ({"similarity": -math.inf}, "similarity"),
        ({"WIDTH": -64}, "width"),
        ({"HEIGHT": -1}, "height"),
        ({"pwatermark": -0.1}, "pwatermark"),
        ({"pwatermark": math.inf}, "pwatermark"),
        ({"punsafe": -1e-9}, "punsafe"),
    ],
)
def test_negative_and_infinite_values_fail_their_rule_even_below_a_negative_threshold(tmp_path, change, rule):
    floats = {"WIDTH": float, "HEIGHT": float}
    rows = [{k: floats.get(k, lambda v: v)(v) for k, v in r.items()} for r in laion_rows({}, change, {})]
    metrics, kept = filter_rows(tmp_path, rows, PERMISSIVE)
    assert metrics[f"dropped_{rule}"] == 1 and metrics["rows_out"] == 2
    assert kept["url"].to_list() == ["http://example.com/0.jpg", "http://example.com/2.jpg"]


def test_numbers_stored_as_text_are_parsed_and_non_numbers_fail_their_rule(tmp_path):
    rows = laion_rows({}, {}, {}, {})
    texts = {"WIDTH": ["64", "abc", " 64", "64.0"], "AESTHETIC_SCORE": ["6.0", "6.5", "7", "nan"]}
    for column, values in texts.items():
        for row, value in zip(rows, values, strict=True):
            row[column] = value
    metrics, kept = filter_rows(tmp_path, rows)
    assert pl.read_parquet(tmp_path / "meta" / "part-0.parquet").schema["WIDTH"] == pl.String
    assert (metrics["dropped_width"], metrics["dropped_aesthetic"], metrics["rows_out"]) == (2, 1, 1)
    assert kept["url"].to_list() == ["http://example.com/0.jpg"]
    assert kept["width"].dtype == pl.Int64 and kept["width"].to_list() == [64]
    assert kept["aesthetic"].to_list() == [6.0]


def test_files_with_different_column_types_are_filtered_together(tmp_path):
    meta = tmp_path / "meta"
    meta.mkdir()
    a = laion_rows({}, {"hash": 7})
    b = [{**r, "URL": r["URL"] + "?b", "WIDTH": str(r["WIDTH"]), "hash": str(r["hash"])} for r in laion_rows({}, {})]
    b[1]["hash"] = "7"  # the same hash as a[1], stored as text
    pl.DataFrame(a).write_parquet(meta / "a.parquet")
    pl.DataFrame(b).write_parquet(meta / "b.parquet")
    source = Source(kind="laion", repo="unused", filter=RULES)
    metrics = filter_metadata.run(source, "laion", meta, tmp_path / "out")
    kept = pl.read_parquet(tmp_path / "out" / "filtered.parquet")
    assert (metrics["files"], metrics["rows_in"], metrics["dropped_duplicate_hash"], metrics["rows_out"]) == (
        2,
        4,
        2,
        2,
    )
    assert kept["hash"].dtype == pl.String and kept["hash"].to_list() == ["1000", "7"]
    assert kept["width"].to_list() == [64, 64]


@pytest.mark.parametrize("damage", ["not_parquet", "truncated", "empty"])
def test_an_unreadable_file_is_an_input_error_naming_it(tmp_path, damage):
    meta = tmp_path / "meta"
    meta.mkdir()
    pl.DataFrame(laion_rows({}, {})).write_parquet(meta / "a.parquet")
    bad = meta / "b.parquet"
    pl.DataFrame(laion_rows({}, {})).write_parquet(bad)
    data = bad.read_bytes()
    bad.write_bytes(
        {"not_parquet": b"<html>rate limited</html>", "truncated": data[: len(data) // 2], "empty": b""}[damage]
    )
    source = Source(kind="laion", repo="unused", filter=RULES)
    with pytest.raises(InputError, match=rf"{bad}: not a readable parquet file .*re-run download_metadata"):
        filter_metadata.run(source, "laion", meta, tmp_path / "out")


def test_corrupt_data_pages_are_an_input_error_naming_the_file(tmp_path):
    meta = tmp_path / "meta"
    meta.mkdir()
    bad = meta / "part-0.parquet"
    pl.DataFrame(laion_rows(*[{}] * 2000)).write_parquet(bad, compression="snappy")
    data = bytearray(bad.read_bytes())
    for i in range(100, 300):  # inside the first column chunk; the footer stays intact
        data[i] ^= 0xFF
    bad.write_bytes(bytes(data))
    source = Source(kind="laion", repo="unused", filter=RULES)
    with pytest.raises(InputError, match=rf"{bad}: corrupt parquet data"):
        filter_metadata.run(source, "laion", meta, tmp_path / "out")


def test_a_column_of_an_impossible_type_is_named_with_its_file(tmp_path):
    rows = [{**r, "WIDTH": [r["WIDTH"]]} for r in laion_rows({}, {})]
    with pytest.raises(InputError, match=r"part-0.parquet: column 'WIDTH' \(columns.width\) has type List"):
        filter_rows(tmp_path, rows)


def test_a_missing_column_names_the_file_it_is_missing_from(tmp_path):
    meta = tmp_path / "meta"
    meta.mkdir()
    pl.DataFrame(laion_rows({})).write_parquet(meta / "a.parquet")
    pl.DataFrame(laion_rows({})).drop("similarity").write_parquet(meta / "b.parquet")
    with pytest.raises(InputError, match=r"b.parquet: column 'similarity' \(columns.similarity\) not found"):
        filter_metadata.run(Source(kind="laion", repo="unused", filter=RULES), "laion", meta, tmp_path / "out")


def test_empty_and_null_captions_are_kept_and_a_very_long_one_is_cut_flagged_and_counted(tmp_path):
    long = "a very long caption " * 5000  # 100,000 characters
    metrics, kept = filter_rows(
        tmp_path, laion_rows({"TEXT": ""}, {"TEXT": None}, {"TEXT": long}, {"TEXT": "é" * 4096})
    )
    assert (metrics["rows_out"], metrics["captions_truncated"]) == (4, 1)
    assert kept["caption"].to_list() == ["", None, long[:4096], "é" * 4096]
    assert kept["caption_truncated"].to_list() == [False, False, True, False]


def test_hidden_folders_are_not_read(tmp_path):
    meta = tmp_path / "meta"
    (meta / ".cache" / "huggingface").mkdir(parents=True)
    pl.DataFrame(laion_rows({})).write_parquet(meta / "part-0.parquet")
    (meta / ".cache" / "huggingface" / "part-0.parquet").write_bytes(b"not parquet")
    metrics = filter_metadata.run(Source(kind="laion", repo="unused", filter=RULES), "laion", meta, tmp_path / "out")
    assert (metrics["files"], metrics["rows_out"]) == (1, 1)


# --- duplicate keys ---------------------------------------------------------------------------------


def test_duplicate_keys_count_once_and_hash_dedup_sees_only_rows_url_dedup_kept(tmp_path):
    rows = laion_rows(
        {"URL": "http://a.com/1", "hash": 1, "TEXT": "first a"},
        {"URL": "http://A.COM/1", "hash": 1, "TEXT": "url and hash repeat: counted under url"},
        {"URL": "http://a.com/2", "hash": 2, "TEXT": "dropped by url dedup below"},
        {"URL": "http://a.com/2", "hash": 3, "TEXT": "url repeat (its hash 3 is new)"},
        {"URL": "http://a.com/3", "hash": 3, "TEXT": "hash 3 is new among the rows url dedup kept"},
        {"URL": "http://a.com/4", "hash": 1, "TEXT": "hash repeat"},
        {"URL": "   ", "hash": 4, "TEXT": "blank url"},
        {"URL": "http://a.com/5", "hash": 2, "TEXT": "hash 2 repeats the kept row 2"},
    )
    metrics, kept = filter_rows(tmp_path, rows)
    assert (metrics["dropped_duplicate_url"], metrics["dropped_duplicate_hash"], metrics["rows_out"]) == (3, 2, 3)
    assert kept["caption"].to_list() == [
        "first a",
        "dropped by url dedup below",
        "hash 3 is new among the rows url dedup kept",
    ]


def test_empty_text_hash_is_dropped_as_a_missing_key(tmp_path):
    metrics, kept = filter_rows(tmp_path, laion_rows({"hash": "a"}, {"hash": ""}, {"hash": "b"}))
    assert (metrics["dropped_duplicate_hash"], metrics["rows_out"]) == (1, 2)
    assert kept["hash"].to_list() == ["a", "b"]


def test_url_first_compares_both_hash_halves_when_the_first_collides():
    keys = pl.DataFrame(
        {
            "_url_valid": [True, True, True, False, True, True],
            "_url0": [5, 5, 5, 9, 9, 7],
            "_url1": [1, 2, 1, 3, 3, 4],
        },
        schema_overrides={"_url0": pl.UInt64, "_url1": pl.UInt64},
    )
    # rows 0/1 collide on the first half only (both first); row 2 repeats row 0; row 3 is invalid,
    # so row 4 is the first valid one of its key
    assert laion_dedup.url_first(keys).to_list() == [True, True, False, False, True, True]


@pytest.mark.parametrize(
    "url",
    [
        "http://Example.com/A.jpg",
        "  HTTP://EXAMPLE.COM/A.jpg ",
        "HTTPS://Ex.com?Q=A",
        "ftp://HOST.COM#Frag",
        "HTTP://",
        "Example.com/A",
        "1http://X.com/A",
        "h t://X.com/A",
        "http://HÉ.com/É",
        "HTTP://X.COM/a\nB",
        "HTTP://X\nY.COM/a",
        "",
        None,
    ],
)
def test_url_normalisation_matches_the_regex_definition(url):
    def reference(value):
        if value is None:
            return None
        value = value.strip()
        match = re.fullmatch(r"([A-Za-z][A-Za-z0-9+.\-]*://[^/?#]*)(.*)", value)
        return match.group(1).lower() + match.group(2) if match else value

    lf = pl.LazyFrame({"url": [url]}, schema={"url": pl.String})
    assert laion_dedup.with_normalized_url(lf, "url", "key").collect()["key"].to_list() == [reference(url)]


# --- histograms, engine settings ----------------------------------------------------------------------


def test_histograms_count_every_row_before_and_the_kept_rows_after(tmp_path):
    meta = tmp_path / "meta"
    meta.mkdir()
    rows = laion_rows(
        {"AESTHETIC_SCORE": 6.05, "similarity": 0.3},
        {"AESTHETIC_SCORE": 1.0, "similarity": 0.3},
        {"AESTHETIC_SCORE": 12.0, "similarity": 0.3},  # above the range: the last bin
        {"AESTHETIC_SCORE": None, "similarity": math.nan},  # in no bin
        {"AESTHETIC_SCORE": 6.05, "similarity": 0.45, "URL": "http://example.com/0.jpg"},
    )
    pl.DataFrame(rows).write_parquet(meta / "p.parquet")
    metrics, hist = laion_filter.filter_laion(meta, tmp_path / "out.parquet", Columns(), RULES)
    assert (metrics["rows_in"], metrics["rows_out"], metrics["dropped_duplicate_url"]) == (5, 2, 1)
    nonzero = {name: {i: n for i, n in enumerate(counts) if n} for name, counts in hist.before.items()}
    assert nonzero == {"aesthetic": {10: 1, 60: 2, 99: 1}, "similarity": {60: 3, 90: 1}}
    nonzero = {name: {i: n for i, n in enumerate(counts) if n} for name, counts in hist.after.items()}
    assert nonzero == {"aesthetic": {60: 1, 99: 1}, "similarity": {60: 2}}
    assert all(len(counts) == 100 for counts in [*hist.before.values(), *hist.after.values()])


def test_polars_env_is_set_for_the_block_only_and_a_user_setting_wins(monkeypatch):
    monkeypatch.delenv("POLARS_ROW_GROUP_PREFETCH_SIZE", raising=False)
    with laion_filter._polars_env(POLARS_ROW_GROUP_PREFETCH_SIZE="2"):
        assert os.environ["POLARS_ROW_GROUP_PREFETCH_SIZE"] == "2"
    assert "POLARS_ROW_GROUP_PREFETCH_SIZE" not in os.environ
    monkeypatch.setenv("POLARS_ROW_GROUP_PREFETCH_SIZE", "8")
    with laion_filter._polars_env(POLARS_ROW_GROUP_PREFETCH_SIZE="2"):
        assert os.environ["POLARS_ROW_GROUP_PREFETCH_SIZE"] == "8"
    assert os.environ["POLARS_ROW_GROUP_PREFETCH_SIZE"] == "8"


def test_urls_the_cheap_check_skips_are_exactly_those_normalising_leaves_alone():
    import random

    rng = random.Random(7)
    alphabet = ["a", "Z", "é", "Ä", "/", "?", "#", ":", ".", "-", "+", "1", " ", "\n", "h", "t", "p", "s"]
    urls = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14))) for _ in range(3000)]
    urls += [
        f"{scheme}://{host}{rest}"
        for scheme in ("http", "HTTP", "hTtp", "h1+.-", "1http")
        for host in ("example.com", "Example.com", "ÉXAMPLE.com", "exämple.com", "")
        for rest in ("", "/A", "?Q", "#F", "/a\nB")
    ]
    df = pl.DataFrame({"url": urls}).with_columns(pl.col("url").str.strip_chars())
    out = laion_dedup.with_normalized_url(df.lazy(), "url", "key").with_columns(
        pl.col("url").str.contains(laion_dedup._URL_HEAD_NOT_LOWER).alias("checked")
    )
    out = out.collect()
    changed = out.filter(pl.col("key") != pl.col("url"))
    assert changed.height > 40 and changed["checked"].all()  # every URL that normalising changes is checked
    assert out.filter(~pl.col("checked"))["key"].equals(out.filter(~pl.col("checked"))["url"])


def test_a_url_with_an_upper_case_host_repeats_its_lower_case_twin_in_either_order(tmp_path):
    rows = laion_rows(
        {"URL": "http://example.com/p.jpg", "TEXT": "lower first"},
        {"URL": "http://EXAMPLE.com/p.jpg", "TEXT": "upper repeat"},
        {"URL": "HTTP://Other.com/q.jpg", "TEXT": "upper first"},
        {"URL": "http://other.com/q.jpg", "TEXT": "lower repeat"},
    )
    metrics, kept = filter_rows(tmp_path, rows)
    assert (metrics["dropped_duplicate_url"], metrics["rows_out"]) == (2, 2)
    assert kept["caption"].to_list() == ["lower first", "upper first"]
