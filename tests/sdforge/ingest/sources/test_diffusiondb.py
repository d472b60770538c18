"""DiffusionDB (zipped parts + JSON mapping): filter rows onto the common schema and re-shard them."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import get_args

import numpy as np
import polars as pl
import pytest

from sdforge.config import Source
from sdforge.ingest import image_convert, shards, sources
from sdforge.ingest.image_convert import resized_size
from stages import fetch_images, filter_metadata
from tests.fixtures.sources import BLUE, check_tar_layout, close_to, decode, image_bytes, statuses


def test_demo_diffusiondb_keeps_every_image(demo_params, run_until):
    metrics = run_until(demo_params, "filter_metadata")["filter_metadata@diffusiondb"]
    n = demo_params.demo.archive_images
    assert (metrics["files"], metrics["rows_in"], metrics["rows_out"]) == (1, n, n)
    assert {k: v for k, v in metrics.items() if k.startswith("dropped_")} == {
        "dropped_bad_metadata": 0,
        "dropped_unsafe_member": 0,
        "dropped_no_caption": 0,
        "dropped_missing": 0,
        "dropped_duplicate": 0,
    }
    df = pl.read_parquet(Path(demo_params.paths.filtered) / "diffusiondb" / "filtered.parquet")
    assert df.columns == ["archive", "member", "caption", "meta", "caption_truncated"]
    assert df["archive"].unique().to_list() == ["part-000001.zip"]
    assert df["member"].to_list() == sorted(df["member"])
    assert set(json.loads(df["meta"][0])) == {"seed", "cfg", "steps", "sampler"}


def write_zip(path: Path, images: dict[str, bytes], mapping: dict, extra: list[tuple[str, bytes]] = ()) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in [*images.items(), *extra]:
            zf.writestr(name, data)
        zf.writestr(path.stem + ".json", json.dumps(mapping))


@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_diffusiondb_drop_reasons_each_counted_once(tmp_path):
    meta = tmp_path / "meta"
    entry = {"p": "prompt", "se": 1, "c": 7.0, "st": 50, "sa": "k_lms"}
    write_zip(
        meta / "part-000001.zip",
        {"a.png": b"x", "b.png": b"y", "twice.png": b"1", "../evil.png": b"e", "nul.png": b"n"},
        {
            "a.png": entry,
            "b.png": entry,
            "gone.png": entry,
            "../evil.png": entry,
            "/abs.png": entry,
            "nul.png": {"p": None, "se": 2},
            "twice.png": entry,
        },
        extra=[("twice.png", b"2")],
    )
    write_zip(
        meta / "part-000002.zip",
        {"a.png": b"x", "c.png": b"z"},
        {"a.png": entry, "c.png": {"p": "", "c": float("nan")}},
    )
    source = Source(kind="diffusiondb", repo="unused", allow_patterns=["*.zip"])
    metrics = filter_metadata.run(source, "diffusiondb", meta, tmp_path / "out")
    assert metrics == {
        "files": 2,
        "rows_in": 9,
        "dropped_bad_metadata": 0,
        "dropped_unsafe_member": 2,
        "dropped_no_caption": 1,
        "dropped_missing": 1,
        "dropped_duplicate": 2,  # a.png again in part 2; twice.png stored twice in part 1
        "rows_out": 3,
        "captions_truncated": 0,
    }
    kept = pl.read_parquet(tmp_path / "out" / "filtered.parquet")
    assert kept.select("archive", "member", "caption").rows() == [
        ("part-000001.zip", "a.png", "prompt"),
        ("part-000001.zip", "b.png", "prompt"),
        ("part-000002.zip", "c.png", ""),  # an empty prompt is a caption, kept as is
    ]
    assert [json.loads(m) for m in kept["meta"]][::2] == [
        {"seed": 1, "cfg": 7.0, "steps": 50, "sampler": "k_lms"},
        {"seed": None, "cfg": None, "steps": None, "sampler": None},  # NaN → null,
    ]


def fetch_diffusiondb(params, out: Path | None = None, **fetch_changes) -> dict:
    source = params.sources["diffusiondb"]
    source = source.model_copy(update={"fetch": source.fetch.model_copy(update=fetch_changes)})
    paths = params.paths
    out = out or Path(paths.shards) / "diffusiondb"
    return fetch_images.run(
        source, "diffusiondb", Path(paths.filtered) / "diffusiondb", Path(paths.metadata) / "diffusiondb", out
    )


def test_diffusiondb_reshards_every_archive_image(demo_params, run_until, tree_digest, tmp_path):
    run_until(demo_params, "filter_metadata")
    n = demo_params.demo.archive_images
    metrics = fetch_diffusiondb(demo_params)
    assert {k: metrics[k] for k in ("samples", "successes", "failed_to_download", "failed_to_resize", "shards")} == {
        "samples": n,
        "successes": n,
        "failed_to_download": 0,
        "failed_to_resize": 0,
        "shards": 3,
    }
    out = Path(demo_params.paths.shards) / "diffusiondb"
    check_tar_layout(out)
    filtered = pl.read_parquet(Path(demo_params.paths.filtered) / "diffusiondb" / "filtered.parquet")
    row_of = {r["member"]: r for r in filtered.to_dicts()}
    samples = list(shards.iter_samples(out))
    assert [k for k, _ in samples] == [shards.sample_key(i, 4)[1] for i in range(n)]
    assert samples[4][0] == "000010"  # img2dataset's scheme: shard 1 starts at 1 * 10**ceil(log10(4))
    for key, sample in samples:
        meta = json.loads(sample["json"])
        row = row_of[meta["member"]]
        assert sample["txt"].decode() == row["caption"] == meta["caption"]
        kept = resized_size(meta["original_width"], meta["original_height"], 32, "keep_ratio")  # shorter side 32
        assert (meta["key"], meta["source"], meta["width"], meta["height"]) == (key, "diffusiondb", *kept)
        assert (meta["original_width"], meta["original_height"]) in {(48, 48), (48, 32), (32, 48)}  # demo canvases
        assert meta["seed"] == json.loads(row["meta"])["seed"]  # the row's meta fields are in the sample's json
        assert decode(sample["jpg"]).shape == (kept[1], kept[0], 3)
    stats = json.loads((out / "00002_stats.json").read_text())
    assert stats == {
        "count": 2,
        "successes": 2,
        "failed_to_download": 0,
        "failed_to_resize": 0,
        "status_dict": {"success": 2},
    }

    digest = tree_digest(out)
    fetch_diffusiondb(demo_params)
    assert tree_digest(out) == digest
    fetch_diffusiondb(demo_params, tmp_path / "parallel", processes=2)
    assert tree_digest(tmp_path / "parallel") == digest


def test_diffusiondb_reshard_counts_corrupt_missing_and_too_small(tmp_path):
    import cv2

    rng = np.random.default_rng(0)
    images = {
        "gray.png": cv2.imencode(".png", rng.integers(0, 255, (40, 60), dtype=np.uint8))[1].tobytes(),
        "blue.png": image_bytes(40, 40, BLUE, "PNG"),
        "small.png": image_bytes(20, 40, BLUE, "PNG"),
        "corrupt.png": b"\x89PNG\r\n\x1a\nnot really",
    }
    mapping = {name: {"p": name, "se": 1} for name in images}
    meta_dir = tmp_path / "meta"
    write_zip(meta_dir / "part-000001.zip", images, mapping)
    source = Source(
        kind="diffusiondb", repo="unused", filter={"min_width": 32}, fetch={"image_size": 32, "shard_size": 10}
    )
    assert filter_metadata.run(source, "diffusiondb", meta_dir, tmp_path / "filtered")["rows_out"] == 4
    # a row the filter would not write (hand-edited parquet): the member is missing
    filtered = tmp_path / "filtered" / "filtered.parquet"
    rows = pl.read_parquet(filtered)
    extra = pl.DataFrame(
        [{"archive": "part-000001.zip", "member": "gone.png", "caption": "x", "meta": "{}", "caption_truncated": False}]
    )
    import pyarrow.parquet as pq

    table = pl.concat([rows, extra]).to_arrow().replace_schema_metadata(pq.read_schema(filtered).metadata)
    pq.write_table(table, filtered)
    metrics = fetch_images.run(source, "diffusiondb", tmp_path / "filtered", meta_dir, tmp_path / "out")
    assert (metrics["samples"], metrics["successes"], metrics["failed_to_download"], metrics["failed_to_resize"]) == (
        5,
        2,
        1,
        1,
    )
    assert statuses(tmp_path / "out") == {
        "blue.png": "success",
        "corrupt.png": "failed_to_resize",
        "gone.png": "failed_to_download",
        "gray.png": "success",
        "small.png": "too_small",  # min_width travels in filtered.parquet's metadata to the re-shard step
    }
    samples = {json.loads(s["json"])["member"]: s for _, s in shards.iter_samples(tmp_path / "out")}
    jpg = decode(samples["blue.png"]["jpg"])
    assert jpg.shape == (32, 32, 3) and close_to(tuple(jpg[16, 16]), BLUE)


@pytest.mark.parametrize(
    ("mode", "shape"),
    [("center_crop", (32, 32)), ("keep_ratio", (64, 32)), ("border", (32, 32)), ("no", (80, 40))],
)
def test_resize_modes(mode, shape):
    img = np.full((80, 40, 3), 200, np.uint8)
    out = image_convert.resize(img, 32, mode)
    assert out.shape[:2] == shape
    if mode == "border":
        assert out[:, 0].max() == 0 and out[16, 16].min() == 200


def test_every_source_kind_has_a_filter_and_fetch_adapter():
    kinds = set(get_args(Source.model_fields["kind"].annotation))
    assert kinds == {"laion"} | sources.LOCAL_KINDS
    assert kinds <= fetch_images.SUPPORTED_KINDS
