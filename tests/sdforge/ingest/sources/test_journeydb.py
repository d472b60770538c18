"""JourneyDB: tgz image archives + annotation JSONL.tgz, with configs/full/params.yaml's allow_patterns."""

from __future__ import annotations

import json

import polars as pl

from sdforge.ingest.image_convert import resized_size
from stages import filter_metadata
from tests.fixtures.sources import (
    BLUE,
    GREEN,
    RED,
    centre_colour,
    close_to,
    decode,
    full_source,
    image_bytes,
    journeydb_record,
    run_source,
    samples_by_member,
    status_totals,
    write_journeydb,
)


def journeydb_repo(root):
    write_journeydb(
        root,
        {
            "000": {
                "aaa.jpg": image_bytes(64, 48, RED),
                "bbb.jpg": image_bytes(48, 64, GREEN),
                "small.jpg": image_bytes(20, 20),
            },
            "001": {"ccc.jpg": image_bytes(40, 40, BLUE), "nul.jpg": image_bytes(40, 40)},
            "150": {"zzz.jpg": image_bytes(40, 40)},  # not matched by allow_patterns (00[0-9].tgz)
        },
        [
            journeydb_record("./000/aaa.jpg", "a red prompt", "a red description"),
            journeydb_record("./000/bbb.jpg", "a green prompt " * 100, "a green description"),  # long: kept as is
            journeydb_record("./000/small.jpg", "tiny", "tiny"),
            journeydb_record("./001/ccc.jpg", "", "a blue description"),  # an empty prompt is kept
            journeydb_record("./000/aaa.jpg", "the same image again", "again"),
            journeydb_record("./001/nul.jpg", None, "a description without a prompt"),
            journeydb_record("../../etc/passwd", "escape", "escape"),
            "{not json",
            journeydb_record("./150/zzz.jpg", "its archive was not downloaded", "x"),
            journeydb_record("./001/absent.jpg", "not in the archive", "x"),
        ],
    )
    return root


def test_journeydb_end_to_end_prompt_captions(tmp_path):
    source = full_source("journeydb", journeydb_repo(tmp_path / "repo"), filter={"min_width": 32, "min_height": 32})
    filtered, fetched, out = run_source(source, "journeydb", tmp_path / "work")
    assert filtered == {
        "files": 3,  # the annotation archive, 000.tgz, 001.tgz
        "rows_in": 10,
        "dropped_bad_record": 1,
        "dropped_json_too_deep": 0,
        "dropped_json_too_large": 0,
        "dropped_json_too_many_entries": 0,
        "dropped_unsafe_member": 1,
        "dropped_missing": 1,
        "dropped_no_caption": 1,
        "dropped_duplicate": 1,
        "rows_out": 5,
        "captions_truncated": 0,
    }
    rows = pl.read_parquet(tmp_path / "work" / "filtered" / "filtered.parquet")
    assert rows.select("archive", "member").rows() == [
        ("data/train/imgs/000.tgz", "000/aaa.jpg"),
        ("data/train/imgs/000.tgz", "000/bbb.jpg"),
        ("data/train/imgs/000.tgz", "000/small.jpg"),
        ("data/train/imgs/001.tgz", "001/absent.jpg"),
        ("data/train/imgs/001.tgz", "001/ccc.jpg"),
    ]
    assert (fetched["samples"], fetched["successes"], fetched["failed_to_download"], fetched["shards"]) == (5, 3, 1, 2)
    assert status_totals(out) == {"success": 3, "too_small": 1, "failed_to_download": 1}  # min size at re-shard time
    samples = samples_by_member(out)
    assert sorted(samples) == ["000/aaa.jpg", "000/bbb.jpg", "001/ccc.jpg"]
    assert samples["000/aaa.jpg"]["txt"] == "a red prompt"
    assert samples["000/bbb.jpg"]["txt"] == "a green prompt " * 100
    assert samples["001/ccc.jpg"]["txt"] == ""
    assert samples["001/ccc.jpg"]["key"] == "000011"  # 001.tgz's rows start shard 1 (001/absent.jpg is 000010)
    expected = {"000/aaa.jpg": ((64, 48), RED), "000/bbb.jpg": ((48, 64), GREEN), "001/ccc.jpg": ((40, 40), BLUE)}
    for member, (original, colour) in expected.items():
        meta = samples[member]["json"]
        kept = resized_size(*original, 32, "keep_ratio")  # the full config fetches keep_ratio: shorter side 32
        assert decode(samples[member]["jpg"]).shape == (kept[1], kept[0], 3)
        assert (meta["width"], meta["height"], meta["original_width"], meta["original_height"]) == (*kept, *original)
        assert close_to(centre_colour(samples[member]["jpg"]), colour)
        assert meta["source"] == "journeydb" and meta["archive"].endswith(member[:3] + ".tgz")
    assert samples["000/aaa.jpg"]["json"]["task2_caption"] == "a red description"


def test_journeydb_caption_option_uses_task2_caption(tmp_path):
    repo = journeydb_repo(tmp_path / "repo")
    source = full_source("journeydb", repo, journeydb={"caption": "caption"})
    metrics = filter_metadata.run(source, "journeydb", repo, tmp_path / "filtered")
    assert metrics["files"] == 4 and metrics["rows_out"] == 7  # 150.tgz is there; nul.jpg has a caption
    assert (metrics["dropped_no_caption"], metrics["dropped_missing"]) == (0, 0)
    rows = pl.read_parquet(tmp_path / "filtered" / "filtered.parquet")
    caption = dict(rows.select("member", "caption").iter_rows())
    assert caption["000/aaa.jpg"] == "a red description" and caption["001/nul.jpg"] == "a description without a prompt"
    meta = json.loads(rows.filter(pl.col("member") == "001/nul.jpg")["meta"][0])
    assert meta == {"prompt": None, "task2_caption": "a description without a prompt"}
