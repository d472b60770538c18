"""One decode policy for both fetch paths: the same file fetched from a URL (img2dataset) and from a local folder
(re-shard) gets the same status and message, the same ``original_width/height`` and the same JPEG bytes."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import cv2
import numpy as np
import polars as pl
import pyarrow.parquet as pq
from PIL import Image

from sdforge.config import Source
from sdforge.demo.http_server import serve_directory
from sdforge.ingest import shards
from stages import download_metadata, fetch_images, filter_metadata
from tests.fixtures.sources import BLUE, RED, close_to, decode, image_bytes, write_files

FETCH = {"image_size": 16, "shard_size": 16, "processes": 1, "threads": 2, "timeout": 5, "retries": 0}


def exif_rotated_jpeg() -> bytes:
    """Stored 40 wide × 20 high, top half red / bottom half blue; EXIF orientation 6: displayed 20 × 40, rotated
    90° clockwise (the red half on the right)."""
    img = Image.new("RGB", (40, 20), RED)
    img.paste(BLUE, (0, 10, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue()


def radiance_hdr() -> bytes:
    """A float (Radiance RGBE) image, bright: OpenCV decodes it as float32, PIL does not open it."""
    ok, buf = cv2.imencode(".hdr", np.full((24, 24, 3), 4.0, np.float32))
    assert ok
    return buf.tobytes()


FILES = {
    "rotated.jpg": exif_rotated_jpeg(),
    "hdr.jpg": radiance_hdr(),  # served and stored as .jpg
    "zero.jpg": b"",
    "plain.png": image_bytes(30, 20, BLUE, "PNG"),
    "gray16.png": cv2.imencode(".png", np.full((24, 24), 30000, np.uint16))[1].tobytes(),
}


def _rows(out: Path) -> dict[str, dict]:
    """Each tried sample's parquet row, by caption, plus the SHA-256 of its JPEG (None when it has none)."""
    jpegs = {key: sample["jpg"] for key, sample in shards.iter_samples(out)}
    rows = {}
    for path in sorted(out.glob("*.parquet")):
        for row in pq.read_table(path).to_pylist():
            jpeg = jpegs.get(row["key"])
            rows[row["caption"]] = {
                "status": row["status"],
                "error_message": row["error_message"],
                "size": (row["width"], row["height"]),
                "original": (row["original_width"], row["original_height"]),
                "jpeg": None if jpeg is None else hashlib.sha256(jpeg).hexdigest(),
                "pixels": None if jpeg is None else decode(jpeg),
            }
    return rows


def test_the_same_file_gives_the_same_sample_from_a_url_and_from_a_folder(tmp_path):
    repo = tmp_path / "repo"
    write_files(repo, FILES | {f"{Path(name).stem}.txt": name for name in FILES})
    local = Source(kind="local", repo=str(repo), allow_patterns=["*"], fetch=FETCH)
    meta, filtered = tmp_path / "metadata", tmp_path / "filtered_local"
    download_metadata.run(local, meta)
    filter_metadata.run(local, "local", meta, filtered)
    fetch_images.run(local, "local", filtered, meta, tmp_path / "from_folder")

    web = Source(kind="laion", repo="unused", fetch=FETCH | {"allow_networks": ["127.0.0.0/8"]})
    (tmp_path / "filtered_web").mkdir()
    with serve_directory(repo, 0) as base:
        table = {"url": [f"{base}/{name}" for name in FILES], "caption": list(FILES)}
        pl.DataFrame(table).write_parquet(tmp_path / "filtered_web" / "filtered.parquet")
        web_metrics = fetch_images.run(web, "web", tmp_path / "filtered_web", tmp_path, tmp_path / "from_url")

    from_folder, from_url = _rows(tmp_path / "from_folder"), _rows(tmp_path / "from_url")
    assert set(from_folder) == set(from_url) == set(FILES)
    for name in FILES:
        folder_row, url_row = from_folder[name], from_url[name]
        for field in ("status", "error_message", "size", "original", "jpeg"):
            assert folder_row[field] == url_row[field], (name, field, folder_row[field], url_row[field])

    rotated = from_url["rotated.jpg"]
    assert rotated["original"] == (20, 40)  # as displayed: EXIF orientation applied, then the size taken
    assert close_to(tuple(rotated["pixels"][8, 2]), BLUE) and close_to(tuple(rotated["pixels"][8, 13]), RED)
    assert from_url["hdr.jpg"]["status"] == "failed_to_resize" and from_url["hdr.jpg"]["jpeg"] is None
    assert from_url["hdr.jpg"]["error_message"].startswith("not a readable image")
    assert from_url["zero.jpg"]["status"] == "failed_to_resize"
    assert "\n" not in from_url["zero.jpg"]["error_message"]
    assert from_url["plain.png"]["original"] == (30, 20) and from_url["gray16.png"]["status"] == "success"
    assert web_metrics["error_decode"] == 2 and web_metrics["successes"] == 3
    sample_meta = [json.loads(s["json"]) for _, s in shards.iter_samples(tmp_path / "from_url")]
    assert {(m["original_width"], m["original_height"]) for m in sample_meta} == {(20, 40), (30, 20), (24, 24)}
