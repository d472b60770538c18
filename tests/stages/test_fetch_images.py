"""fetch_images: img2dataset over the loopback demo (real CLI), DiffusionDB re-sharding, determinism."""

from __future__ import annotations

import base64
import collections
import gzip
import hashlib
import io
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import cv2
import numpy as np
import polars as pl
import pytest
import webdataset as wds
from PIL import Image

from sdforge.config import FetchSettings, Source
from sdforge.demo.http_server import serve_directory
from sdforge.ingest import fetch_state, shards, url_fetch, url_guard
from sdforge.ingest.image_convert import resized_size
from sdforge.io import InputError
from stages import fetch_images
from tests.fixtures.sources import check_tar_layout

REPO = Path(__file__).resolve().parents[2]
NO_FAILURES = dict.fromkeys(url_guard.REASONS, 0)


def decode(jpeg: bytes) -> np.ndarray:
    assert jpeg[:2] == b"\xff\xd8", "not a JPEG"
    return cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_UNCHANGED)


def test_laion_cli_fetches_good_rows_from_the_loopback_server(demo_params, run_until, tmp_path):
    run_until(demo_params, "filter_metadata")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "stages.fetch_images", "--params", "params.yaml", "--item", "laion"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    demo = demo_params.demo
    good, tried = demo.laion_rows, demo.laion_rows + demo.missing_rows
    metrics = json.loads((tmp_path / "metrics" / "fetch_images" / "laion.json").read_text())
    assert metrics == {
        "samples": tried,
        "successes": good,
        "failed_to_download": demo.missing_rows,
        "failed_to_resize": 0,
        "success_rate": round(good / tried, 6),
        "shards": 2,
        **NO_FAILURES,
        "error_http": demo.missing_rows,
    }
    out = Path(demo_params.paths.shards) / "laion"
    assert sorted(p.name for p in out.iterdir()) == [fetch_state.FINGERPRINT_FILE] + [
        f"0000{i}{ext}" for i in range(2) for ext in (".parquet", ".tar", "_stats.json")
    ]
    check_tar_layout(out)
    filtered = pl.read_parquet(Path(demo_params.paths.filtered) / "laion" / "filtered.parquet")
    caption_of = dict(filtered.select("url", "caption").iter_rows())
    samples = list(shards.iter_samples(out))
    assert len(samples) == good and len({k for k, _ in samples}) == good
    for key, sample in samples:
        meta = json.loads(sample["json"])
        assert meta["key"] == key and len(key) == 7  # shard_size 16: 2 digits per sample + 5 per shard
        assert sample["txt"].decode() == caption_of[meta["url"]] == meta["caption"]
        kept = resized_size(meta["original_width"], meta["original_height"], 32, "keep_ratio")  # aspect kept
        assert decode(sample["jpg"]).shape == (kept[1], kept[0], 3) and min(kept) == 32
        assert "/images/shape-" in meta["url"]
    tried_rows = pl.concat([pl.read_parquet(p) for p in sorted(out.glob("*.parquet"))])
    assert tried_rows.height == tried and tried_rows["key"].is_sorted()
    assert set(tried_rows.filter(pl.col("status") != "success")["error_message"]) == {"HTTP Error 404: File not found"}


def test_laion_without_server_warns_that_the_network_is_the_cause(demo_params, run_until, caplog):
    run_until(demo_params, "filter_metadata")
    source, paths = demo_params.sources["laion"], demo_params.paths
    with caplog.at_level(logging.WARNING, logger="stages.fetch_images"):
        metrics = fetch_images.run(
            source,
            "laion",
            Path(paths.filtered) / "laion",
            Path(paths.metadata) / "laion",
            Path(paths.shards) / "laion",
        )
    tried = demo_params.demo.laion_rows + demo_params.demo.missing_rows
    assert (metrics["samples"], metrics["successes"], metrics["failed_to_download"]) == (tried, 0, tried)
    assert metrics["success_rate"] == 0.0
    assert metrics["error_network"] == tried  # connection refused
    assert "DNS or network access is the likely cause" in caplog.text


def test_busy_demo_port_is_an_input_error(demo_params, run_until):
    run_until(demo_params, "filter_metadata")
    paths = demo_params.paths
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", demo_params.demo.http_port))
        busy.listen()
        with pytest.raises(InputError, match="change demo.http_port"):
            fetch_images.run(
                demo_params.sources["laion"],
                "laion",
                Path(paths.filtered) / "laion",
                Path(paths.metadata) / "laion",
                Path(paths.shards) / "laion",
                serve=(Path(paths.demo_source) / "http", demo_params.demo.http_port),
            )


def test_canonicalize_sorts_samples_and_fixes_mtime(tmp_path):
    path = tmp_path / "00000.tar"
    with wds.TarWriter(str(path)) as writer:
        for key in ("003", "001", "002"):
            writer.write({"__key__": key, "jpg": b"j" + key.encode(), "txt": key, "json": "{}"})
    assert shards.canonicalize_tar(path) == 3
    expected = shards.tar_bytes(
        {"__key__": k, "jpg": b"j" + k.encode(), "txt": k, "json": "{}"} for k in ("001", "002", "003")
    )
    assert path.read_bytes() == expected
    assert list(shards.read_tar(path)) == ["001", "002", "003"]


def test_demo_http_serves_files_and_404s(tmp_path, free_port):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "a.jpg").write_bytes(b"abc")
    with serve_directory(tmp_path, free_port()) as base:
        assert urllib.request.urlopen(f"{base}/images/a.jpg", timeout=5).read() == b"abc"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{base}/images/missing.jpg", timeout=5)
        assert err.value.code == 404


def test_summarize_stats_counts_other_statuses_as_skipped(tmp_path):
    shards.write_stats(
        tmp_path / "00000_stats.json",
        {
            "count": 9,
            "successes": 3,
            "failed_to_download": 1,
            "failed_to_resize": 0,
            "status_dict": {"success": 3, "unsafe_member": 1, "too_large": 2, "HTTP Error 404: File not found": 1},
        },
    )
    shards.write_stats(
        tmp_path / "00001_stats.json",
        {"count": 2, "successes": 0, "failed_to_download": 0, "failed_to_resize": 0, "status_dict": {"duplicate": 2}},
    )
    assert shards.summarize_stats(tmp_path) == {
        "samples": 11,
        "successes": 3,
        "failed_to_download": 1,
        "failed_to_resize": 0,
        "success_rate": round(3 / 11, 6),
        "shards": 0,
        "skipped_duplicate": 2,
        "skipped_too_large": 2,
        "skipped_unsafe_member": 1,
    }


def _png_bomb(width: int, height: int) -> bytes:
    """A valid grayscale PNG of ``width`` × ``height`` zero pixels: ~1000× smaller than its pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    row = b"\0" * (width + 1)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _encoded(mode: str, colour, fmt: str = "PNG", size=(24, 24)) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, colour).save(buf, fmt)
    return buf.getvalue()


def _snapshot(root: Path, skip: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in root.rglob("*")
        if skip not in p.parents and p != skip
    }


RGB_CASES = {  # served file -> (bytes, expected RGB of the output JPEG)
    "good.jpg": (_encoded("RGB", (30, 60, 200), "JPEG"), (30, 60, 200)),
    "gray.png": (_encoded("L", 100), (100, 100, 100)),
    "gray16.png": (cv2.imencode(".png", np.full((24, 24), 30000, np.uint16))[1].tobytes(), (117, 117, 117)),
    "cmyk.jpg": (_encoded("CMYK", (55, 225, 215, 0), "JPEG"), (200, 30, 40)),  # PIL's RGB(200, 30, 40).convert("CMYK")
    "rgba.png": (_encoded("RGBA", (255, 0, 0, 128)), (255, 127, 127)),  # alpha-matted on white
    "palette.png": (_encoded("P", 3), None),  # filled in below: the palette's colour 3
    "rgb16.png": (
        cv2.imencode(".png", np.full((24, 24, 3), [1000, 30000, 65535], np.uint16))[1].tobytes(),
        (255, 117, 4),
    ),
}


def test_hostile_inputs_are_counted_skips_and_write_nothing_outside_out_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    www = tmp_path / "www"
    www.mkdir()
    palette = Image.new("P", (24, 24), 3)
    palette.putpalette([0, 0, 0] * 3 + [10, 200, 30] + [0, 0, 0] * 252)
    buf = io.BytesIO()
    palette.save(buf, "PNG")
    cases = {**RGB_CASES, "palette.png": (buf.getvalue(), (10, 200, 30))}
    for name, (data, _) in cases.items():
        (www / name).write_bytes(data)
    (www / "caption.jpg").write_bytes(_encoded("RGB", (0, 128, 0), "JPEG"))
    good = cases["good.jpg"][0]
    (www / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0" + bytes(range(256)) * 4)
    (www / "truncated.jpg").write_bytes(_encoded("RGB", (5, 5, 5), "JPEG", (300, 300))[:400])
    (www / "zero.jpg").write_bytes(b"")
    (www / "bomb.png").write_bytes(_png_bomb(12_000, 8_000))  # 96 Mpx > the default max_image_pixels
    secret = tmp_path / "secret.txt"
    secret.write_bytes(good)  # a valid image: fetched, it would land in the shards
    hits = collections.Counter()
    long_caption = "very long caption " * 6000
    redirects = {"/to-metadata": "http://169.254.169.254/latest/meta-data/", "/to-file": secret.as_uri()}
    with serve_directory(www, 0, hits=hits, redirects=redirects, errors={"/boom": 500}) as base:
        rows = [(f"{base}/{name}", name) for name in cases]
        rows += [(f"{base}/caption.jpg?{i}", caption) for i, caption in enumerate([None, "", long_caption])]
        rows += [(f"{base}/{name}", name) for name in ("corrupt.jpg", "truncated.jpg", "zero.jpg", "bomb.png")]
        rows += [(f"{base}/missing.jpg", "404"), (f"{base}/boom", "500")]
        rows += [(f"{base}/to-metadata", "redirect ssrf"), (f"{base}/to-file", "redirect file")]
        rows += [
            ("file:///etc/passwd", "file"),
            (secret.as_uri(), "local image"),
            ("ftp://127.0.0.1/x.jpg", "ftp"),
            ("data:image/jpeg;base64," + base64.b64encode(good).decode(), "data"),
            ("gopher://127.0.0.1:70/1", "gopher"),
            ("www/good.jpg", "no scheme"),
        ]
        filtered = tmp_path / "filtered"
        filtered.mkdir()
        pl.DataFrame({"url": [u for u, _ in rows], "caption": [c for _, c in rows]}).write_parquet(
            filtered / "filtered.parquet"
        )
        out = tmp_path / "shards"
        before = _snapshot(tmp_path, out)
        fetch = FetchSettings(image_size=16, processes=1, threads=4, timeout=5, allow_networks=["127.0.0.0/8"])
        metrics = fetch_images.run(Source(kind="laion", repo="unused", fetch=fetch), "h", filtered, tmp_path, out)
    assert _snapshot(tmp_path, out) == before  # nothing written (or changed) outside out_dir
    successes = len(cases) + 3
    assert metrics == {
        "samples": len(rows),
        "successes": successes,
        "failed_to_download": len(rows) - successes - 4,
        "failed_to_resize": 4,
        "success_rate": round(successes / len(rows), 6),
        "shards": 1,
        **NO_FAILURES,
        "refused_scheme": 7,
        "refused_ssrf": 1,
        "error_http": 2,
        "error_decode": 3,
        "error_too_many_pixels": 1,
    }
    assert hits["/to-metadata"] == hits["/to-file"] == hits["/bomb.png"] == 1
    table = pl.read_parquet(out / "00000.parquet")
    by_caption = {row["caption"]: row for row in table.to_dicts()}
    assert by_caption["bomb.png"]["error_message"] == (  # refused from its header (never decoded)
        "12000x8000 = 96000000 pixels > fetch.max_image_pixels 89478485"
    )
    assert by_caption["404"]["error_message"] == "HTTP Error 404: File not found"
    assert by_caption["500"]["error_message"].startswith("HTTP Error 500")
    for caption in ("file", "local image", "ftp", "data", "gopher", "no scheme", "redirect file"):
        assert url_guard.REFUSED_SCHEME in by_caption[caption]["error_message"], caption
        assert by_caption[caption]["status"] == "failed_to_download"
    samples = dict(shards.iter_samples(out))
    assert len(samples) == successes
    for sample in samples.values():
        assert good not in sample["jpg"] and b"root:" not in sample["jpg"] + sample["txt"]
        assert decode(sample["jpg"]).shape[:2] == (16, 16)
    by_name = {sample["txt"].decode(): sample for sample in samples.values()}
    for name, (_, rgb) in cases.items():
        bgr = cv2.imdecode(np.frombuffer(by_name[name]["jpg"], np.uint8), cv2.IMREAD_COLOR)
        assert np.abs(bgr[8, 8].astype(int) - rgb[::-1]).max() <= 6, (name, bgr[8, 8], rgb)
    captions = sorted(
        s["txt"].decode() for s in samples.values() if json.loads(s["json"])["url"].endswith(("?0", "?1", "?2"))
    )
    assert captions == ["", "", long_caption]


def _wds_tar(samples: list[dict]) -> bytes:
    buf = io.BytesIO()
    with wds.TarWriter(buf, encoder=False, mtime=shards.TAR_MTIME) as writer:
        for sample in samples:
            writer.write({k: v.encode() if isinstance(v, str) and k != "__key__" else v for k, v in sample.items()})
    return buf.getvalue()


TAR_CASES = [
    [],
    [{"__key__": "a", "txt": "é" * 300, "jpg": b"x" * 512, "json": ""}],
    [{"__key__": "k" * 150, "json": "{}", "jpg": b"\0" * 513}],  # a name past ustar's 100 bytes: PAX path
    [{"__key__": f"{i:07d}", "jpg": bytes([i]) * (i * 37 % 1500), "txt": "c" * i, "json": "{}"} for i in range(40)],
]


@pytest.mark.parametrize("samples", TAR_CASES)
def test_tar_bytes_and_read_tar_match_webdataset(samples, tmp_path):
    """The fast writer and reader give webdataset's bytes and tarfile's samples."""
    assert shards.tar_bytes(samples) == _wds_tar(sorted(samples, key=lambda s: s["__key__"]))
    path = tmp_path / "x.tar"
    path.write_bytes(_wds_tar(samples[::-1]))
    assert shards._tar_index(path.read_bytes()) is not None  # the fast path
    assert shards.read_tar(path) == shards._read_tar_slow(path)
    assert shards.canonicalize_tar(path) == len(samples)
    assert path.read_bytes() == shards.tar_bytes(samples)


@pytest.mark.parametrize("tar_format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_read_tar_other_layouts_and_compression(tar_format, tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tar_format) as tar:
        for name in ("d/" * 60 + "k1.jpg", "k2.txt", "k2.json"):  # a long name: ustar prefix, GNU 'L', PAX path
            info = tarfile.TarInfo(name)
            info.size = len(name)
            tar.addfile(info, io.BytesIO(name.encode()))
        folder = tarfile.TarInfo("somedir")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
    expected = {
        "d/" * 60 + "k1": {"jpg": ("d/" * 60 + "k1.jpg").encode()},
        "k2": {"txt": b"k2.txt", "json": b"k2.json"},
    }
    for path, data in ((tmp_path / "x.tar", buf.getvalue()), (tmp_path / "x.tar.gz", gzip.compress(buf.getvalue()))):
        path.write_bytes(data)
        assert shards.read_tar(path) == expected
        assert shards.canonicalize_tar(path) == 2
        assert shards.read_tar(path) == expected
        assert path.read_bytes() == shards.tar_bytes({"__key__": k, **v} for k, v in expected.items())


@pytest.mark.parametrize("distributor", [None, "multiprocessing", "pyspark", "ray"])
def test_distributor_is_passed_to_img2dataset(distributor, tmp_path, monkeypatch):
    """``sources.<name>.fetch.distributor`` (default multiprocessing) reaches ``img2dataset.download``."""
    import img2dataset

    calls = []
    monkeypatch.setattr(img2dataset, "download", lambda **kwargs: calls.append(kwargs))
    fetch = FetchSettings() if distributor is None else FetchSettings(distributor=distributor)
    with pytest.raises(url_fetch.FetchIncomplete):  # the stand-in wrote no shard
        url_fetch.fetch_urls(tmp_path / "filtered.parquet", tmp_path / "out", fetch, rows=1)
    assert [c["distributor"] for c in calls] == [distributor or "multiprocessing"]


def test_unknown_distributor_is_a_config_error_naming_the_key():
    import yaml

    from sdforge.config import ConfigError, parse_params

    data = yaml.safe_load((REPO / "params.yaml").read_text())
    data["sources"]["laion"]["fetch"]["distributor"] = "dask"
    with pytest.raises(ConfigError) as err:
        parse_params(data, origin="params.yaml")
    msg = str(err.value)
    assert "sources.laion.fetch.distributor" in msg and "'dask'" in msg
    assert all(name in msg for name in ("multiprocessing", "pyspark", "ray"))


def test_rerun_refetches_when_the_served_images_change_under_the_same_urls(demo_params, run_until):
    """The demo's URLs name images by index: a new corpus (e.g. other shape sizes) keeps every URL and caption,
    so only the served bytes tell that the finished shards are stale (they once were kept and trained on)."""
    run_until(demo_params, "filter_metadata")
    paths = demo_params.paths
    root = Path(paths.demo_source) / "http"
    out = Path(paths.shards) / "laion"

    def fetch() -> set[str]:
        fetch_images.run(
            demo_params.sources["laion"],
            "laion",
            Path(paths.filtered) / "laion",
            Path(paths.metadata) / "laion",
            out,
            serve=(root, demo_params.demo.http_port),
        )
        return {hashlib.sha256(s["jpg"]).hexdigest() for _, s in shards.iter_samples(out)}

    first = fetch()
    image = sorted((root / "images").glob("shape-*.jpg"))[0]
    pixels = cv2.imdecode(np.frombuffer(image.read_bytes(), np.uint8), cv2.IMREAD_COLOR)
    image.write_bytes(cv2.imencode(".jpg", 255 - pixels)[1].tobytes())
    second = fetch()
    assert len(second) == len(first) and len(second - first) == 1


def test_the_low_success_warning_blames_the_network_only_for_url_sources(tmp_path):
    metrics = {"success_rate": 0.25, "samples": 8}
    laion = fetch_images.low_success_message("laion", "laion", metrics, 0.5, tmp_path)
    assert "only 25.0% of 8 images fetched (fetch.min_success_rate 50%). DNS or network access" in laion
    for kind in ("diffusiondb", "journeydb", "local", "coco", "vggface2"):
        message = fetch_images.low_success_message("src", kind, metrics, 0.5, tmp_path)
        assert "DNS" not in message and "no network is involved" in message and str(tmp_path) in message
