"""condition_images: each latent's Canny map is the edges of exactly the pixels the latent encodes (its bucket crop),
row for row; a rerun reuses finished shards and a threshold change redoes them; a sample that is missing, does not
decode or decodes to another crop is a counted skip naming it; without kinds nothing is made."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from safetensors.numpy import load_file

from sdforge.config import CannySettings, Conditions
from sdforge.control.edges import canny_edges, edge_f1, pack_edges, unpack_edges
from sdforge.control.shards import DecodeRules
from sdforge.ingest.shards import tar_bytes
from sdforge.latents import store
from sdforge.latents.inputs import decode_sample
from stages import condition_images, encode_latents
from tests.fixtures.encode_inputs import BUCKETS, build_models, cfg, mixed_tars

CANNY = CannySettings(low_threshold=20, high_threshold=60)
"""Low enough for the smooth random test images to have edges."""
RULES = {"square": DecodeRules(tuple(BUCKETS), "resize")}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    return build_models(tmp_path_factory.mktemp("models"))


@pytest.fixture
def encoded(models, tmp_path) -> tuple[Path, Path]:
    """Two tars (square, and mixed aspects over three buckets) encoded at the buckets: (shards, latents of source)."""
    mixed_tars(tmp_path / "shards")
    encode_latents.run(cfg(), "laion", tmp_path / "shards", models, tmp_path / "latents/laion/square", BUCKETS)
    return tmp_path / "shards", tmp_path / "latents/laion"


def _run(encoded, out: Path, **kw) -> dict:
    shards, latents = encoded
    return condition_images.run(Conditions(kinds=["canny"], canny=kw.pop("canny", CANNY)), "laion", shards, latents,
                                out, RULES, **kw)  # fmt: skip


def _condition(out: Path, shard: int, bucket: tuple[int, int], row: int) -> tuple[np.ndarray, int]:
    arrays = load_file(out / "square/canny" / store.shard_name(shard, bucket))
    return unpack_edges(arrays["canny"][row], bucket[1], bucket[0]), int(arrays["valid"][row])


def _tar_samples(path: Path) -> dict[str, dict[str, bytes]]:
    with tarfile.open(fileobj=io.BytesIO(path.read_bytes())) as tf:
        files = {m.name: tf.extractfile(m).read() for m in tf if m.isfile()}
    out: dict[str, dict[str, bytes]] = {}
    for name, data in files.items():
        key, ext = name.split(".", 1)
        out.setdefault(key, {})[ext] = data
    return out


def test_each_condition_is_the_canny_map_of_its_latents_crop(encoded, tmp_path):
    out = tmp_path / "conditions"
    metrics = _run(encoded, out)
    assert (metrics["conditions"], metrics["skipped"], metrics["shards_made"]) == (12, 0, 2)
    manifest = pl.read_parquet(encoded[1] / "square" / store.MANIFEST)
    samples = {**_tar_samples(encoded[0] / "00000.tar"), **_tar_samples(encoded[0] / "00001.tar")}
    edge_pixels = 0
    for row in manifest.iter_rows(named=True):
        bucket = (row["bucket_width"], row["bucket_height"])
        got, valid = _condition(out, row["shard"], bucket, row["row"])
        image = decode_sample(row["key"], samples[row["key"]], BUCKETS).image  # the encoder's crop of the sample
        assert valid == 1 and got.shape == (bucket[1], bucket[0])
        assert np.array_equal(got, canny_edges(image, 20, 60)), row["key"]
        edge_pixels += int(got.sum())
    assert edge_pixels > 100  # the maps are not empty
    marker = json.loads((out / "square/canny/shard-00001.json").read_text())
    assert marker["conditions"] == 7 and marker["skipped"] == {} and len(marker["files"]) == 3


def test_a_rerun_reuses_finished_shards_and_new_thresholds_redo_them(encoded, tmp_path):
    out = tmp_path / "conditions"
    _run(encoded, out)
    files = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted((out / "square/canny").iterdir())}
    again = _run(encoded, out)
    assert (again["shards_reused"], again["shards_made"], again["conditions"]) == (2, 0, 12)
    assert files == {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted((out / "square/canny").iterdir())}
    redone = _run(encoded, out, canny=CannySettings(low_threshold=5, high_threshold=15))
    assert (redone["shards_reused"], redone["shards_made"]) == (0, 2)
    assert _condition(out, 1, BUCKETS[2], 0)[0].sum() > 0
    wide = store.shard_name(1, BUCKETS[2])
    assert (out / "square/canny" / wide).read_bytes() != files[wide][0]


def test_missing_undecodable_and_mismatched_samples_are_counted_skips_naming_them(encoded, tmp_path, caplog):
    """Tar 1 loses sample 1000 and sample 1001's JPEG is damaged; sample 1003's manifest row says another crop."""
    shards, latents = encoded
    samples = _tar_samples(shards / "00001.tar")
    del samples["1000"]
    samples["1001"]["jpg"] = b"\xff\xd8 not a jpeg"
    (shards / "00001.tar").write_bytes(tar_bytes({"__key__": k, **files} for k, files in sorted(samples.items())))
    part_path = latents / "square" / store.part_name(1)
    part, meta = store.read_part(part_path)
    crops = part.column("crop_left").to_pylist()
    at = part.column("key").to_pylist().index("1003")
    crops[at] += 1
    store.write_part(part_path, part.set_column(part.schema.get_field_index("crop_left"), "crop_left",
                                                [np.array(crops, np.int32)]), meta)  # fmt: skip
    out = tmp_path / "conditions"
    metrics = _run(encoded, out)
    assert (metrics["conditions"], metrics["skipped"]) == (9, 3)
    assert (metrics["skipped.missing"], metrics["skipped.undecodable"], metrics["skipped.crop_mismatch"]) == (1, 1, 1)
    skipped = json.loads((out / "square/canny/shard-00001.json").read_text())["skipped"]
    assert sorted(skipped) == ["1000", "1001", "1003"] and skipped["1001"] == "undecodable: corrupt"
    assert skipped["1003"].startswith("crop_mismatch: ")
    named = " ".join(r.getMessage() for r in caplog.records)
    assert all(f"sample {key} has no condition" in named for key in ("1000", "1001", "1003"))
    rows = pl.from_arrow(part)
    for key in ("1000", "1001", "1003"):
        r = rows.filter(pl.col("key") == key).row(0, named=True)
        assert _condition(out, 1, (r["bucket_width"], r["bucket_height"]), r["row"])[1] == 0  # no condition there


def test_without_kinds_nothing_is_made_and_earlier_conditions_are_removed(encoded, tmp_path):
    out = tmp_path / "conditions"
    _run(encoded, out)
    metrics = condition_images.run(Conditions(), "laion", *encoded, out, RULES)
    assert metrics == {"enabled": False, "conditions": 0, "seconds": metrics["seconds"]}
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == ["settings.json"]


def test_the_files_of_a_latent_shard_that_is_gone_are_removed(encoded, tmp_path):
    out = tmp_path / "conditions"
    _run(encoded, out)
    for path in (encoded[1] / "square").glob("shard-00001*"):
        path.unlink()
    metrics = _run(encoded, out)
    assert (metrics["conditions"], metrics["shards_reused"]) == (5, 1)
    assert sorted(p.name for p in (out / "square/canny").iterdir()) == ["shard-00000-16x16.safetensors",
                                                                      "shard-00000.json"]  # fmt: skip


def test_edge_maps_pack_to_a_bit_each_and_f1_is_the_overlap():
    edges = np.zeros((5, 7), bool)
    edges[1, 2:6] = True
    packed = pack_edges(edges)
    assert packed.shape == (5,) and np.array_equal(unpack_edges(packed, 5, 7), edges)
    half = edges.copy()
    half[1, 4:6] = False  # 2 of the 4 edge pixels found, none extra: precision 1, recall 0.5
    assert edge_f1(edges, half) == pytest.approx(2 / 3)
    assert edge_f1(edges, edges) == 1.0 and edge_f1(edges, np.zeros_like(edges)) == 0.0
    assert edge_f1(np.zeros_like(edges), np.zeros_like(edges)) == 1.0
    with pytest.raises(ValueError, match="RGB uint8"):
        canny_edges(np.zeros((4, 4), np.uint8), 10, 20)


def test_thresholds_out_of_order_are_refused():
    with pytest.raises(ValueError, match="low_threshold 90 is above high_threshold 50"):
        CannySettings(low_threshold=90, high_threshold=50)
