"""COCO 2017: instances + captions JSON and train2017/ images, with configs/full/params.yaml's patterns."""

from __future__ import annotations

from sdforge.ingest.image_convert import resized_size
from tests.fixtures.sources import (
    BLUE,
    GREEN,
    RED,
    centre_colour,
    close_to,
    coco_image,
    full_source,
    image_bytes,
    run_source,
    samples_by_member,
    write_coco,
)


def test_coco_end_to_end_tall_person_filter_and_captions(tmp_path):
    repo = tmp_path / "repo"
    images = [
        coco_image(3, 40, 50),  # person 0.54 of the height; a crowd box and a tall dog do not count
        coco_image(1, 40, 50),  # person 0.6
        coco_image(2, 50, 50),  # person exactly 0.55 (kept: ≥)
        coco_image(4, 40, 50),  # only invalid boxes (negative height, null bbox)
        coco_image(1, 40, 50),  # the same id again
        coco_image(6, 40, 50, "../evil.jpg"),
        {**coco_image(7, 40, 50), "width": None},
        coco_image(8, 20, 20),  # below filter.min_width
        coco_image(9, 40, 50),  # no caption
        coco_image(10, 40, 50),  # no image file
        coco_image(11, 40, 60, "extra/000000000011.jpg"),  # the image sits under the folder its file_name names
    ]
    boxes = [
        (3, [0, 0, 10, 27], 0),
        (3, [0, 0, 40, 50], 1),
        (1, [0, 0, 10, 10], 0),
        (1, [5, 5, 10, 30], 0),
        (2, [0, 0, 10, 27.5], 0),
        (4, [0, 0, 10, -40], 0),
        (4, None, 0),
        *[(i, [0, 0, 10, 50], 0) for i in (6, 7, 8, 9, 10)],
        (11, [0, 0, 10, 59], 0),
    ]
    captions = [(7, 1, "second by id"), (3, 1, "first by id"), (5, 2, ""), (6, 2, None), (8, 11, "eleven")]
    captions += [(20 + i, i, f"caption {i}") for i in (3, 4, 6, 7, 8, 10)]
    files = {
        "train2017/000000000001.jpg": image_bytes(40, 50, RED),
        "train2017/000000000002.jpg": image_bytes(50, 50, GREEN),
        "train2017/000000000003.jpg": image_bytes(40, 50),
        "train2017/000000000009.jpg": image_bytes(40, 50),
        "extra/000000000011.jpg": image_bytes(40, 60, BLUE),
    }
    write_coco(repo, images, boxes, captions, files)
    patterns = [*full_source("coco", repo).allow_patterns, "extra/*.jpg"]
    source = full_source("coco", repo, filter={"min_width": 32}, allow_patterns=patterns)
    filtered, fetched, out = run_source(source, "coco", tmp_path / "work")
    assert filtered == {
        "files": 2,
        "rows_in": 11,
        "dropped_bad_record": 0,
        "dropped_duplicate": 1,
        "dropped_unsafe_member": 1,
        "dropped_bad_size": 1,
        "dropped_too_small": 1,
        "dropped_no_person": 2,
        "dropped_no_caption": 1,
        "dropped_missing": 1,
        "rows_out": 3,
        "captions_truncated": 0,
        "invalid_boxes": 2,
        "invalid_captions": 1,
    }
    assert (fetched["samples"], fetched["successes"], fetched["shards"]) == (3, 3, 1)
    samples = samples_by_member(out)
    assert sorted(samples) == ["extra/000000000011.jpg", "train2017/000000000001.jpg", "train2017/000000000002.jpg"]
    one = samples["train2017/000000000001.jpg"]
    assert one["txt"] == "first by id"  # the lowest annotation id
    assert one["json"]["captions"] == ["first by id", "second by id"]
    assert (one["json"]["image_id"], one["json"]["person_height"], one["json"]["persons"]) == (1, 0.6, 1)
    assert samples["train2017/000000000002.jpg"]["txt"] == ""  # empty caption kept as is
    assert samples["extra/000000000011.jpg"]["txt"] == "eleven"
    for member, (size, colour) in {
        "train2017/000000000001.jpg": ((40, 50), RED),
        "train2017/000000000002.jpg": ((50, 50), GREEN),
        "extra/000000000011.jpg": ((40, 60), BLUE),
    }.items():
        meta = samples[member]["json"]
        kept = resized_size(*size, 32, "keep_ratio")  # the full config fetches keep_ratio: shorter side 32
        assert (meta["width"], meta["height"], meta["original_width"], meta["original_height"]) == (*kept, *size)
        assert close_to(centre_colour(samples[member]["jpg"]), colour)
