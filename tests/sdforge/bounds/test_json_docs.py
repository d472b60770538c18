"""JSON from data files within limits (issue 39, case 1): a 200,000-level document in each place the project
parses data JSON costs that record (counted under its reason) or is an error naming the file and the key —
never a ``RecursionError`` — and the good records beside it are kept."""

from __future__ import annotations

import json
import zipfile

import polars as pl
import pytest

from sdforge.bounds import json_docs
from sdforge.bounds.json_docs import JsonLimitError
from sdforge.config import FilterRules, InputLimits, JourneyDbOptions, LocalOptions
from sdforge.ingest.sources.coco import filter_coco
from sdforge.ingest.sources.diffusiondb import filter_diffusiondb
from sdforge.ingest.sources.journeydb import filter_journeydb
from sdforge.ingest.sources.local import filter_local
from sdforge.io import InputError
from sdforge.latents.inputs import decode_sample
from sdforge.preflight.samples import journeydb_record, write_coco, write_files, write_journeydb
from tests.fixtures.sources import BLUE, RED, coco_image, full_source, image_bytes

DEEP = "[" * 200_000 + "]" * 200_000
"""The trial's document: nested 200,000 levels (the stdlib parser raised RecursionError on it)."""
LIMITS = InputLimits()


# -- the parser --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [DEEP, '{"a":' * 200_000 + "1" + "}" * 200_000, "[" * 33 + "]" * 33])
def test_documents_deeper_than_the_limit_are_a_named_limit_error(text):
    with pytest.raises(JsonLimitError, match=r"sources\.<source>\.inputs\.json_max_depth: 32") as err:
        json_docs.loads(text, LIMITS)
    assert err.value.reason == "json_too_deep" and isinstance(err.value, ValueError)


def test_the_depth_limit_is_exact_and_counts_every_container():
    assert json_docs.loads("[" * 32 + "]" * 32, LIMITS) == json.loads("[" * 32 + "]" * 32)
    nested = {"a": [1, {"b": [2, [3]]}]}  # depth 5
    assert json_docs.loads(json.dumps(nested), InputLimits(json_max_depth=5)) == nested
    with pytest.raises(JsonLimitError, match="deeper than 4 levels"):
        json_docs.loads(json.dumps(nested), InputLimits(json_max_depth=4))


def test_size_and_entry_limits_name_their_key_and_values_parse_as_the_stdlib_does():
    with pytest.raises(JsonLimitError, match=r"JSON document of 12 bytes .*json_max_bytes: 11") as err:
        json_docs.loads(b'{"a": "bcd"}', InputLimits(json_max_bytes=11))
    assert err.value.reason == "json_too_large"
    with pytest.raises(JsonLimitError, match=r"json_max_entries: 4") as err:
        json_docs.loads("[1, 2, [3, 4]]", InputLimits(json_max_entries=4))  # 3 + 2 values
    assert err.value.reason == "json_too_many_entries"
    assert json_docs.loads("[1, 2, [3]]", InputLimits(json_max_entries=4)) == [1, 2, [3]]
    parsed = json_docs.loads('{"s": NaN, "t": "x", "n": null}', LIMITS)  # NaN: as the stdlib reads it
    assert parsed["s"] != parsed["s"] and parsed["t"] == "x" and parsed["n"] is None
    assert json_docs.loads('"just a string"', LIMITS) == "just a string"
    with pytest.raises(ValueError):
        json_docs.loads("{not json", LIMITS)


# -- each place data JSON enters a stage ---------------------------------------------------------------------------
def _part(path, images: dict[str, bytes], mapping_text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in images.items():
            zf.writestr(name, data)
        zf.writestr(path.stem + ".json", mapping_text)


def test_diffusiondb_a_deep_part_mapping_costs_that_part_only(tmp_path, caplog):
    meta = tmp_path / "meta"
    entry = {"p": "a prompt", "se": 1, "c": 7.0, "st": 50, "sa": "k_lms"}
    _part(meta / "part-000001.zip", {"a.png": b"a", "b.png": b"b"}, json.dumps({"a.png": entry, "b.png": entry}))
    _part(meta / "part-000002.zip", {"c.png": b"c", "d.png": b"d", "e.png": b"e"}, DEEP)
    metrics = filter_diffusiondb(meta, tmp_path / "out.parquet", FilterRules())
    assert (metrics["rows_in"], metrics["dropped_bad_metadata"], metrics["rows_out"]) == (5, 3, 2)
    assert pl.read_parquet(tmp_path / "out.parquet")["member"].to_list() == ["a.png", "b.png"]
    assert "part-000002.zip: part-000002.json: JsonLimitError" in caplog.text and "json_max_depth" in caplog.text


def test_journeydb_a_deep_annotation_line_is_one_counted_record(tmp_path):
    repo = tmp_path / "repo"
    write_journeydb(
        repo,
        {"000": {"aaa.jpg": image_bytes(40, 40, RED), "bbb.jpg": image_bytes(40, 40, BLUE)}},
        [journeydb_record("./000/aaa.jpg", "red"), DEEP, journeydb_record("./000/bbb.jpg", "blue")],
    )
    metrics = filter_journeydb(repo, tmp_path / "out.parquet", JourneyDbOptions(), FilterRules())
    assert (metrics["rows_in"], metrics["dropped_json_too_deep"], metrics["rows_out"]) == (3, 1, 2)
    assert metrics["dropped_bad_record"] == 0
    assert pl.read_parquet(tmp_path / "out.parquet")["caption"].to_list() == ["red", "blue"]


def test_local_a_deep_tag_file_is_one_counted_image(tmp_path):
    repo = tmp_path / "repo"
    write_files(repo, {
        "a.png": image_bytes(40, 40, RED, "PNG"), "a.json": json.dumps({"tags": ["red"], "score": 1}),
        "b.png": image_bytes(40, 40, BLUE, "PNG"), "b.json": DEEP,
        "c.png": image_bytes(40, 40, BLUE, "PNG"), "c.json": json.dumps({"tags": ["big"]}) + " " * 2000,
    })  # fmt: skip
    limits = InputLimits(json_max_bytes=1000)
    metrics = filter_local(repo, tmp_path / "out.parquet", LocalOptions(mode="json"), FilterRules(), limits=limits)
    assert (metrics["rows_in"], metrics["dropped_json_too_deep"], metrics["dropped_json_too_large"]) == (3, 0, 2)
    metrics = filter_local(repo, tmp_path / "out.parquet", LocalOptions(mode="json"), FilterRules())
    assert (metrics["rows_in"], metrics["dropped_json_too_deep"], metrics["rows_out"]) == (3, 1, 2)
    assert pl.read_parquet(tmp_path / "out.parquet")["caption"].to_list() == ["red", "big"]


@pytest.mark.parametrize("which", ["instances", "captions"])
def test_coco_a_deep_annotation_file_is_an_error_naming_it_and_the_key(tmp_path, which):
    repo = tmp_path / "repo"
    write_coco(repo, [coco_image(1, 40, 50)], [(1, [0, 0, 10, 40], 0)], [(7, 1, "a caption")],
               {"train2017/000000000001.jpg": image_bytes(40, 50, RED)})  # fmt: skip
    source = full_source("coco", repo)
    (repo / "annotations" / f"{which}_train2017.json").write_text(DEEP)
    over = rf"{which}_train2017\.json: COCO annotation file over a limit: .*json_max_depth"
    with pytest.raises(InputError, match=over):
        filter_coco(repo, tmp_path / "out.parquet", source.coco, source.filter, source.inputs)
    assert not (tmp_path / "out.parquet").exists()


def test_encode_a_deep_sample_json_keeps_the_sample_with_its_size_unknown():
    image = image_bytes(40, 40, RED, "PNG")
    files = {"png": image, "txt": b"a red square", "json": DEEP.encode()}
    sample = decode_sample("000000001", files, [(32, 32)])
    good = decode_sample("000000001", {**files, "json": b'{"original_width": 40, "original_height": 40}'}, [(32, 32)])
    assert sample.caption == good.caption == "a red square" and sample.problem is None
    assert (sample.original_width, good.original_width) == (None, 40)
    assert sample.image is not None and (sample.image == good.image).all()
