"""Local folder: image + .txt caption, or image + .json tags/score with exclude/remove/replace/bonus/shuffle."""

from __future__ import annotations

import json

import polars as pl

from sdforge.config import Source
from stages import filter_metadata
from tests.fixtures.sources import (
    BLUE,
    GREEN,
    RED,
    centre_colour,
    close_to,
    image_bytes,
    png_header,
    run_source,
    samples_by_member,
    status_totals,
    write_files,
)


def test_local_txt_end_to_end(tmp_path):
    repo = tmp_path / "repo"
    long_caption = "a very long caption " * 100
    write_files(
        repo,
        {
            "a.jpg": image_bytes(40, 40, RED),
            "a.txt": "  a red square\n",
            "b.png": image_bytes(60, 40, GREEN, "PNG"),
            "b.txt": "",
            "sub/c.webp": image_bytes(40, 60, BLUE, "WEBP"),
            "sub/c.txt": long_caption,
            "d.jpg": image_bytes(40, 40),  # no caption file
            "e.jpg": image_bytes(40, 40, BLUE),
            "e.png": image_bytes(40, 40, RED, "PNG"),  # the same stem again
            "e.txt": "e",
            "f.jpg": image_bytes(40, 40),
            "f.txt": b"\xff\xfe not utf-8",
            "g.jpg": b"",  # no size rule: found only when re-sharding
            "g.txt": "empty image",
            "notes.md": "not an image",
        },
    )
    source = Source(kind="local", repo=str(repo), allow_patterns=["*"], fetch={"image_size": 32, "shard_size": 4})
    filtered, fetched, out = run_source(source, "local", tmp_path / "work")
    assert filtered == {
        "files": 8,
        "rows_in": 8,
        "dropped_unsafe_member": 0,
        "dropped_duplicate": 1,
        "dropped_unreadable": 0,
        "dropped_too_small": 0,
        "dropped_no_caption": 1,
        "dropped_bad_caption": 1,
        "dropped_json_too_deep": 0,
        "dropped_json_too_large": 0,
        "dropped_json_too_many_entries": 0,
        "dropped_excluded_tag": 0,
        "dropped_no_score": 0,
        "dropped_low_score": 0,
        "rows_out": 5,
        "captions_truncated": 0,
    }
    assert (fetched["samples"], fetched["successes"], fetched["failed_to_resize"], fetched["shards"]) == (5, 4, 1, 2)
    assert status_totals(out) == {"success": 4, "failed_to_resize": 1}
    samples = samples_by_member(out)
    expected = {
        "a.jpg": ("a red square", (40, 40), RED),
        "b.png": ("", (60, 40), GREEN),
        "e.jpg": ("e", (40, 40), BLUE),
        "sub/c.webp": (long_caption.strip(), (40, 60), BLUE),
    }
    assert sorted(samples) == sorted(expected)
    for member, (caption, size, colour) in expected.items():
        meta = samples[member]["json"]
        assert samples[member]["txt"] == caption
        assert (meta["width"], meta["height"], meta["original_width"], meta["original_height"]) == (32, 32, *size)
        assert close_to(centre_colour(samples[member]["jpg"]), colour)


def tags(tag_list, score="absent") -> str:
    return json.dumps({"tags": tag_list} | ({} if score == "absent" else {"score": score}))


def test_local_json_tag_rules(tmp_path):
    repo = tmp_path / "repo"
    img = image_bytes(40, 40)
    files = {f"{c}.jpg": img for c in "abcdefghi"}
    files |= {
        "a.json": tags(["cat", "watermark", "masterpiece", " cat ", ""], 4),  # 4 + bonus 2 = 6 ≥ 5
        "b.json": tags(["1girl", "nsfw"], 9),
        "c.json": tags(["dog"], 4.5),
        "d.json": tags(["dog"], float("nan")),
        "e.json": tags(["dog"]),
        "f.json": json.dumps({"tags": "dog", "score": 9}),
        "h.json": tags(["1girl", "smile"], 5),
        "i.json": "{broken",
    }
    write_files(repo, files)
    (tmp_path / "outside.jpg").write_bytes(img)
    (repo / "z.jpg").symlink_to(tmp_path / "outside.jpg")
    (repo / "z.json").write_text(tags(["x"], 9))
    options = {
        "mode": "json",
        "exclude_tags": ["nsfw"],
        "remove_tags": ["watermark"],
        "replace_tags": {"1girl": "one girl"},
        "min_score": 5,
        "tag_score_bonus": {"masterpiece": 2},
    }
    source = Source(kind="local", repo=str(repo), local=options)
    metrics = filter_metadata.run(source, "local", repo, tmp_path / "filtered")
    assert metrics == {
        "files": 10,
        "rows_in": 10,
        "dropped_unsafe_member": 1,
        "dropped_duplicate": 0,
        "dropped_unreadable": 0,
        "dropped_too_small": 0,
        "dropped_no_caption": 1,
        "dropped_bad_caption": 2,
        "dropped_json_too_deep": 0,
        "dropped_json_too_large": 0,
        "dropped_json_too_many_entries": 0,
        "dropped_excluded_tag": 1,
        "dropped_no_score": 2,
        "dropped_low_score": 1,
        "rows_out": 2,
        "captions_truncated": 0,
    }
    rows = pl.read_parquet(tmp_path / "filtered" / "filtered.parquet")
    assert rows.select("member", "caption").rows() == [("a.jpg", "cat, masterpiece"), ("h.jpg", "one girl, smile")]
    assert json.loads(rows["meta"][0]) == {"tags": ["cat", "masterpiece"], "score": 4, "adjusted_score": 6}


def test_local_tag_shuffle_is_seeded_and_deterministic(tmp_path):
    repo = tmp_path / "repo"
    ordered = [f"t{i}" for i in range(8)]
    write_files(repo, {f"{i:02d}.jpg": image_bytes(8, 8) for i in range(20)})
    write_files(repo, {f"{i:02d}.json": tags(ordered, 1) for i in range(20)})

    def captions(probability: float, seed: int) -> list[str]:
        source = Source(kind="local", repo=str(repo), local={"mode": "json", "shuffle_tags": probability, "seed": seed})
        filter_metadata.run(source, "local", repo, tmp_path / "filtered")
        return pl.read_parquet(tmp_path / "filtered" / "filtered.parquet")["caption"].to_list()

    plain = ", ".join(ordered)
    assert captions(0.0, 0) == [plain] * 20
    half = captions(0.5, 0)
    assert half == captions(0.5, 0)  # same seed, same captions
    assert 3 <= sum(c != plain for c in half) <= 17
    assert all(sorted(c.split(", ")) == ordered for c in half)  # shuffled, never lost
    assert captions(1.0, 0) != captions(1.0, 1)


def test_a_lying_png_header_is_dropped_before_its_pixels_are_decoded(tmp_path):
    """With a size rule the filter reads headers; one over fetch.max_image_pixels is dropped as unreadable
    (Pillow would otherwise decode every pixel of a PNG looking for EXIF)."""
    repo = tmp_path / "repo"
    write_files(
        repo,
        {
            "good.jpg": image_bytes(40, 40, RED),
            "good.txt": "a red square",
            "huge.png": png_header(80_000, 80_000, idat=b"\x78\x9c\x03\x00\x00\x00\x00\x01"),
            "huge.txt": "claims 6.4 gigapixels",
        },
    )
    source = Source(
        kind="local",
        repo=str(repo),
        allow_patterns=["*"],
        filter={"min_width": 8},
        fetch={"image_size": 32, "shard_size": 4, "max_image_pixels": 1_000_000},
    )
    filtered, fetched, out = run_source(source, "local", tmp_path / "work")
    assert (filtered["rows_in"], filtered["dropped_unreadable"], filtered["rows_out"]) == (2, 1, 1)
    assert list(samples_by_member(out)) == ["good.jpg"]


def test_a_utf8_bom_is_stripped_from_txt_and_json_side_files_alike(tmp_path):
    """Notepad writes a BOM before UTF-8 text: the ``.txt`` caption must not start with U+FEFF, the ``.json`` must
    not be dropped as ``bad_caption``; a BOM inside the text is the caption's own and stays."""
    from sdforge.config import LocalOptions
    from sdforge.ingest.sources.local import caption_of

    bom = b"\xef\xbb\xbf"
    write_files(
        tmp_path,
        {
            "a.jpg": b"",
            "a.txt": bom + b"  a red square\n",
            "b.jpg": b"",
            "b.json": bom + json.dumps({"tags": ["red", "square"], "score": 1}).encode(),
            "c.jpg": b"",
            "c.txt": bom + "a \ufeffword".encode(),
        },
    )
    assert caption_of("a.jpg", tmp_path / "a.jpg", LocalOptions(mode="txt"), max_caption_chars=4096) == (
        "a red square",
        {},
        False,
    )
    assert caption_of("a.jpg", tmp_path / "a.jpg", LocalOptions(mode="txt"))[0] == "a red square"  # unbounded read
    caption, meta, _ = caption_of("b.jpg", tmp_path / "b.jpg", LocalOptions(mode="json"))
    assert caption == "red, square" and meta["tags"] == ["red", "square"]
    inner = caption_of("c.jpg", tmp_path / "c.jpg", LocalOptions(mode="txt"), max_caption_chars=4096)[0]
    assert inner == "a \ufeffword"
