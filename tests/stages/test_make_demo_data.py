"""make_demo_data: row kinds in the LAION parquet, served images, the DiffusionDB zip, determinism."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import cv2
import numpy as np
import polars as pl
import pytest

from sdforge.demo.shapes import parse_caption, probe
from stages import make_demo_data


@pytest.fixture
def built(demo_params):
    """The demo corpus of ``demo_params`` and the stage's metrics."""
    metrics = make_demo_data.run(demo_params.demo, demo_params.paths.demo_source)
    return demo_params, Path(demo_params.paths.demo_source), metrics


def served_file(root: Path, url: str) -> Path:
    """The file under ``root/http`` that a demo URL points to."""
    return root / "http" / url.strip().split("/", 3)[3]


def test_metrics_count_each_row_kind(built):
    params, _, metrics = built
    demo = params.demo
    assert metrics == {
        "enabled": 1,
        "good_rows": demo.laion_rows,
        "missing_rows": demo.missing_rows,
        "low_aesthetic_rows": demo.low_aesthetic_rows,
        "watermark_rows": demo.watermark_rows,
        "nsfw_rows": demo.nsfw_rows,
        "small_rows": demo.small_rows,
        "duplicate_url_rows": 2,
        "duplicate_hash_rows": 2,
        "laion_rows_total": 24 + 3 + 3 + 2 + 2 + 2 + 4,
        "archive_images": demo.archive_images,
        "concept_images": 8,
    }


def test_concept_images_are_a_local_source_of_the_new_colour_only(built):
    params, root, _ = built
    demo = params.demo
    images = sorted((root / "concept").glob("*.png"))
    assert [p.stem for p in images] == [f"{i:05d}" for i in range(8)]
    seen = set()
    for path in images:
        spec = parse_caption((root / "concept" / f"{path.stem}.txt").read_text())
        rgb = cv2.cvtColor(cv2.imread(str(path)), cv2.COLOR_BGR2RGB)
        assert spec.colour == "orange" and probe(rgb, demo.palette, demo.backgrounds).colour == "orange"
        seen.add((spec.shape, spec.background))
    assert len(seen) == 6  # every shape on every background in 8 images (balanced rounds)
    assert "an orange" in (root / "concept/00000.txt").read_text()
    # the LAION and DiffusionDB parts never show it
    captions = pl.read_parquet(root / "laion" / "part-00000.parquet")["TEXT"].to_list()
    assert not any("orange" in c for c in captions)


def test_laion_parquet_has_the_injected_rows(built):
    params, root, _ = built
    demo = params.demo
    df = pl.read_parquet(root / "laion" / "part-00000.parquet")
    assert df.columns == list(params.sources["laion"].columns.model_dump().values())
    assert df.height == 40
    assert (df["AESTHETIC_SCORE"] < 5).sum() == demo.low_aesthetic_rows
    assert (df["pwatermark"] > 0.5).sum() == demo.watermark_rows
    assert (df["punsafe"] > 0.5).sum() == demo.nsfw_rows
    assert ((df["WIDTH"] == 16) & (df["HEIGHT"] == 16)).sum() == demo.small_rows
    assert df["similarity"].is_between(0.3, 0.4).all()
    good = df.filter((pl.col("AESTHETIC_SCORE") >= 5) & (pl.col("pwatermark") < 0.5))
    assert set(good["WIDTH"].to_list()) == {16, 48, 32}  # the small rows and demo.canvases' widths
    urls = df["URL"].to_list()
    assert all(u.strip().lower().startswith(f"http://127.0.0.1:{demo.http_port}/images/") for u in urls)
    served = [u for u in urls if u == u.strip() and served_file(root, u).is_file()]
    assert len(served) == demo.laion_rows
    assert len(list((root / "http" / "images").glob("*.jpg"))) == demo.laion_rows
    assert df["hash"].n_unique() == df.height - 2  # the two hash duplicates


def test_duplicates_follow_their_original(built):
    _, root, _ = built
    df = pl.read_parquet(root / "laion" / "part-00000.parquet")
    seen_urls: set[str] = set()
    seen_hashes: set[int] = set()
    repeats = 0
    for url, h in df.select("URL", "hash").iter_rows():
        norm = url.strip().lower()
        if norm in seen_urls or h in seen_hashes:
            repeats += 1
            assert served_file(root, url).is_file() or h in seen_hashes
        seen_urls.add(norm)
        seen_hashes.add(h)
    assert repeats == 4


def test_served_images_are_demo_shapes(built):
    params, root, _ = built
    df = pl.read_parquet(root / "laion" / "part-00000.parquet")
    rows = [r for r in df.select("URL", "TEXT", "WIDTH", "HEIGHT").iter_rows() if served_file(root, r[0]).is_file()]
    assert len(rows) == params.demo.laion_rows + 2  # + the two URL duplicates (same image)
    for url, caption, width, height in rows:
        img = cv2.imread(str(served_file(root, url)))
        assert img.shape == (height, width, 3)  # the row states the served image's size
        assert (width, height) in params.demo.canvas_sizes
        parse_caption(caption)


def test_diffusiondb_zip_is_in_diffusiondb_format(built):
    params, root, _ = built
    with zipfile.ZipFile(root / "diffusiondb" / "part-000001.zip") as zf:
        names = zf.namelist()
        assert names == sorted(names)
        assert {i.date_time for i in zf.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        mapping = json.loads(zf.read("part-000001.json"))
        pngs = [n for n in names if n.endswith(".png")]
        assert len(pngs) == params.demo.archive_images
        assert sorted(mapping) == pngs
        for name in pngs:
            meta = mapping[name]
            assert set(meta) == {"p", "se", "c", "st", "sa"}
            parse_caption(meta["p"])
            img = cv2.imdecode(np.frombuffer(zf.read(name), np.uint8), cv2.IMREAD_UNCHANGED)
            assert (img.shape[1], img.shape[0]) in params.demo.canvas_sizes and img.shape[2] == 3
            assert zf.read(name)[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_bytes_on_every_run(built, tree_digest):
    params, root, metrics = built
    first = tree_digest(root)
    (root / "stale.txt").write_text("left over")
    assert make_demo_data.run(params.demo, root) == metrics
    assert tree_digest(root) == first


def test_seed_changes_the_data(built, tree_digest):
    params, root, _ = built
    first = tree_digest(root)
    make_demo_data.run(params.demo.model_copy(update={"seed": 1}), root)
    assert tree_digest(root) != first


def test_disabled_writes_only_a_marker(demo_params):
    root = Path(demo_params.paths.demo_source)
    metrics = make_demo_data.run(demo_params.demo.model_copy(update={"enabled": False}), root)
    assert metrics == {"enabled": 0}
    assert [p.name for p in root.iterdir()] == ["DISABLED"]
