"""DiffusionDB (zipped parts + JSON mapping): filter rows and re-shard; the shared re-shard conversions."""

from __future__ import annotations

import json
import tarfile
import zipfile
from pathlib import Path

import cv2
import numpy as np
import polars as pl
import pytest

from stages import fetch_images, filter_metadata, reshard, shards
from stages.config import Source


def decode(jpeg: bytes) -> np.ndarray:
    assert jpeg[:2] == b"\xff\xd8", "not a JPEG"
    return cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_UNCHANGED)


def check_tar_layout(folder: Path) -> None:
    """Every tar's members are sorted, have a fixed mtime and come as jpg/json/txt triples."""
    for tar_path in sorted(folder.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            members = tar.getmembers()
        names = [m.name for m in members]
        assert names == sorted(names)
        assert {m.mtime for m in members} <= {0}
        assert [n.split(".", 1)[1] for n in names] == ["jpg", "json", "txt"] * (len(names) // 3)


def test_demo_diffusiondb_keeps_every_image(demo_params, run_until):
    metrics = run_until(demo_params, "filter_metadata")
    n = demo_params.demo.archive_images
    assert metrics["filter_metadata@diffusiondb"] == {
        "files": 1,
        "rows_in": n,
        "dropped_missing": 0,
        "dropped_duplicate": 0,
        "rows_out": n,
    }
    df = pl.read_parquet(Path(demo_params.paths.filtered) / "diffusiondb" / "filtered.parquet")
    assert df.columns == ["archive", "member", "caption", "seed", "cfg", "steps", "sampler"]
    assert df["archive"].unique().to_list() == ["part-000001.zip"]


def write_zip(path: Path, images: dict[str, bytes], mapping: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in images.items():
            zf.writestr(name, data)
        zf.writestr(path.stem + ".json", json.dumps(mapping))


def test_diffusiondb_drops_missing_members_then_duplicates(tmp_path):
    meta = tmp_path / "meta"
    entry = {"p": "prompt", "se": 1, "c": 7.0, "st": 50, "sa": "k_lms"}
    write_zip(
        meta / "part-000001.zip", {"a.png": b"x", "b.png": b"y"}, {"a.png": entry, "b.png": entry, "gone.png": entry}
    )
    write_zip(meta / "part-000002.zip", {"a.png": b"x", "c.png": b"z"}, {"a.png": entry, "c.png": {"p": "other"}})
    source = Source(kind="diffusiondb", repo="unused", allow_patterns=["*.zip"])
    metrics = filter_metadata.run(source, "diffusiondb", meta, tmp_path / "out")
    assert metrics == {"files": 2, "rows_in": 5, "dropped_missing": 1, "dropped_duplicate": 1, "rows_out": 3}
    kept = pl.read_parquet(tmp_path / "out" / "filtered.parquet")
    assert kept.select("archive", "member").rows() == [
        ("part-000001.zip", "a.png"),
        ("part-000001.zip", "b.png"),
        ("part-000002.zip", "c.png"),
    ]
    assert kept["caption"].to_list() == ["prompt", "prompt", "other"]
    assert kept["seed"].to_list() == [1, 1, None]


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
    assert metrics == {
        "samples": n,
        "successes": n,
        "failed_to_download": 0,
        "failed_to_resize": 0,
        "success_rate": 1.0,
        "shards": 3,
    }
    out = Path(demo_params.paths.shards) / "diffusiondb"
    check_tar_layout(out)
    filtered = pl.read_parquet(Path(demo_params.paths.filtered) / "diffusiondb" / "filtered.parquet")
    caption_of = dict(filtered.select("member", "caption").iter_rows())
    samples = list(shards.iter_samples(out))
    assert [k for k, _ in samples] == [shards.sample_key(i, 4)[1] for i in range(n)]
    assert samples[4][0] == "000010"  # img2dataset's scheme: shard 1 starts at 1 * 10**ceil(log10(4))
    for key, sample in samples:
        meta = json.loads(sample["json"])
        assert sample["txt"].decode() == caption_of[meta["member"]] == meta["caption"]
        assert (meta["key"], meta["source"], meta["width"], meta["height"]) == (key, "diffusiondb", 32, 32)
        assert (meta["original_width"], meta["original_height"]) == (40, 40)
        assert decode(sample["jpg"]).shape == (32, 32, 3)
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


def png(img: np.ndarray) -> bytes:
    return cv2.imencode(".png", img)[1].tobytes()


def test_diffusiondb_decodes_gray_rgba_16bit_and_counts_corrupt_and_missing(tmp_path):
    from stages.config import Source

    rng = np.random.default_rng(0)
    images = {
        "gray.png": png(rng.integers(0, 255, (40, 60), dtype=np.uint8)),
        "rgba.png": png(np.dstack([np.zeros((50, 40, 3), np.uint8), np.zeros((50, 40), np.uint8)])),
        "deep.png": png(rng.integers(0, 65535, (36, 36, 3), dtype=np.uint16)),
        "corrupt.png": b"\x89PNG\r\n\x1a\nnot really",
    }
    meta_dir, filtered_dir = tmp_path / "meta", tmp_path / "filtered"
    meta_dir.mkdir()
    with zipfile.ZipFile(meta_dir / "part-000001.zip", "w") as zf:
        for name, data in images.items():
            zf.writestr(name, data)
    rows = [
        {"archive": "part-000001.zip", "member": m, "caption": m, "seed": 1, "cfg": 7.0, "steps": 50, "sampler": "ddim"}
        for m in [*images, "gone.png"]
    ]
    filtered_dir.mkdir()
    pl.DataFrame(rows).write_parquet(filtered_dir / "filtered.parquet")
    source = Source(kind="diffusiondb", repo="unused", fetch={"image_size": 32, "shard_size": 10})
    metrics = fetch_images.run(source, "diffusiondb", filtered_dir, meta_dir, tmp_path / "out")
    assert metrics == {
        "samples": 5,
        "successes": 3,
        "failed_to_download": 1,
        "failed_to_resize": 1,
        "success_rate": 0.6,
        "shards": 1,
    }
    samples = {json.loads(s["json"])["member"]: s for _, s in shards.iter_samples(tmp_path / "out")}
    assert sorted(samples) == ["deep.png", "gray.png", "rgba.png"]
    for sample in samples.values():
        assert decode(sample["jpg"]).shape == (32, 32, 3)
    assert decode(samples["rgba.png"]["jpg"]).min() > 240  # transparent black composited onto white
    tried = pl.read_parquet(tmp_path / "out" / "00000.parquet")
    assert dict(tried.select("member", "status").iter_rows()) == {
        "corrupt.png": "failed_to_resize",
        "deep.png": "success",
        "gone.png": "failed_to_download",
        "gray.png": "success",
        "rgba.png": "success",
    }


@pytest.mark.parametrize(
    ("mode", "shape"),
    [("center_crop", (32, 32)), ("keep_ratio", (64, 32)), ("border", (32, 32)), ("no", (80, 40))],
)
def test_resize_modes(mode, shape):
    img = np.full((80, 40, 3), 200, np.uint8)
    out = reshard.resize(img, 32, mode)
    assert out.shape[:2] == shape
    if mode == "border":
        assert out[:, 0].max() == 0 and out[16, 16].min() == 200


def test_source_kind_without_adapter_is_refused(tmp_path):
    from stages import fetch_images, filter_metadata
    from stages.common import InputError
    from stages.config import Source

    coco = Source(kind="coco", repo="detection-datasets/coco")
    with pytest.raises(InputError, match="sources.coco.kind: 'coco' has no fetch adapter yet"):
        fetch_images.run(coco, "coco", tmp_path / "f", tmp_path / "m", tmp_path / "o")
    (tmp_path / "meta").mkdir()
    with pytest.raises(InputError, match="sources.coco.kind: 'coco' has no filter adapter yet"):
        filter_metadata.run(coco, "coco", tmp_path / "meta", tmp_path / "out")
