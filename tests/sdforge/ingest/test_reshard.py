"""sdforge.ingest.reshard: pixel formats, bad images, unsafe archive members, duplicates, resume, determinism."""

from __future__ import annotations

import io
import json
import struct
import tarfile
import zipfile
import zlib
from pathlib import Path

import cv2
import numpy as np
import polars as pl
import pytest
from PIL import Image

from sdforge.config import FetchSettings
from sdforge.ingest import reshard
from sdforge.ingest.sources.rows import row, write_rows
from sdforge.io import InputError
from tests.fixtures.sources import (
    BLUE,
    GREEN,
    RED,
    add_member,
    close_to,
    decode,
    image_bytes,
    samples_by_member,
    status_totals,
    statuses,
)

FETCH = FetchSettings(image_size=32, shard_size=4, processes=1)
WHITE = (255, 255, 255)


def pil_bytes(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def palette_image(transparent: bool) -> bytes:
    """40×40 palette image: left half index 0 (red), right half index 1 (green, or transparent)."""
    img = Image.new("P", (40, 40), 0)
    img.putpalette([*RED, *GREEN] + [0] * 762)
    img.paste(1, (20, 0, 40, 40))
    return pil_bytes(img, "PNG", **({"transparency": 1} if transparent else {}))


def exif_rotated_jpeg() -> bytes:
    """Stored 40 wide × 20 high, top half red / bottom half blue; EXIF orientation 6 (display rotated 90° CW)."""
    img = Image.new("RGB", (40, 20), RED)
    img.paste(BLUE, (0, 10, 40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6
    return pil_bytes(img, "JPEG", quality=95, exif=exif.tobytes())


def png_header_only(w: int, h: int) -> bytes:
    """A PNG whose header claims ``w``×``h`` but holds no pixel data (a decompression-bomb stand-in)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


CASES = {
    # name: (bytes, {(row, col) in the 32×32 output: expected RGB})
    "gray": (pil_bytes(Image.new("L", (40, 40), 100)), {(16, 16): (100, 100, 100)}),
    "bilevel": (pil_bytes(Image.new("1", (40, 40), 1)), {(16, 16): WHITE}),
    "cmyk_jpeg": (image_bytes(40, 40, (0, 255, 255, 0), "JPEG", "CMYK"), {(16, 16): (255, 0, 0)}),
    "rgba_half": (image_bytes(40, 40, (255, 0, 0, 128), "PNG", "RGBA"), {(16, 16): (255, 127, 127)}),
    "la_clear": (image_bytes(40, 40, (100, 0), "PNG", "LA"), {(16, 16): WHITE}),
    "palette": (palette_image(False), {(16, 4): RED, (16, 28): GREEN}),
    "palette_trns": (palette_image(True), {(16, 4): RED, (16, 28): WHITE}),
    "gray16": (cv2.imencode(".png", np.full((40, 40), 40000, np.uint16))[1].tobytes(), {(16, 16): (156,) * 3}),
    "rgb16": (
        cv2.imencode(
            ".png",
            np.dstack([np.zeros((40, 40)), np.full((40, 40), 32768), np.full((40, 40), 65535)]).astype(np.uint16),
        )[1].tobytes(),
        {(16, 16): (255, 128, 0)},
    ),
    "webp": (image_bytes(40, 40, BLUE, "WEBP"), {(16, 16): BLUE}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pixel_formats_convert_to_8bit_rgb(name):
    data, expected = CASES[name]
    jpeg, size, original = reshard.convert(data, FETCH)
    img = decode(jpeg)
    assert (img.shape, size, original) == ((32, 32, 3), (32, 32), (40, 40))
    for (y, x), rgb in expected.items():
        assert close_to(tuple(int(v) for v in img[y, x]), rgb, tol=8), (name, (y, x), img[y, x], rgb)


def test_exif_orientation_is_applied():
    fetch = FETCH.model_copy(update={"resize_mode": "keep_ratio"})
    jpeg, size, original = reshard.convert(exif_rotated_jpeg(), fetch)
    img = decode(jpeg)
    assert (size, original) == ((32, 64), (20, 40))  # displayed upright: 20 wide, 40 high
    assert close_to(tuple(int(v) for v in img[32, 4]), BLUE, 20)  # rotated 90° CW: the bottom (blue) is on the left
    assert close_to(tuple(int(v) for v in img[32, 28]), RED, 20)


def test_bad_images_get_a_status_and_a_reason():
    good = image_bytes(64, 64, RED)
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 40 40\nshowpage\n"
    bad = {
        "zero-byte": (b"", "failed_to_resize", "zero-byte"),
        "truncated": (good[: len(good) // 2], "failed_to_resize", "truncated"),
        "garbage": (b"\x89PNG\r\n\x1a\nnot really", "failed_to_resize", "not a readable image"),
        "eps": (eps, "failed_to_resize", "not a readable image"),  # never handed to Ghostscript
        "bomb": (png_header_only(20_000, 20_000), "too_large", "400000000 pixels"),
    }
    for name, (data, status, words) in bad.items():
        with pytest.raises(reshard.ImageRejected) as info:
            reshard.convert(data, FETCH.model_copy(update={"max_image_pixels": 1_000_000}))
        assert (info.value.status, words in info.value.message.lower()) == (status, True), (name, info.value.message)
    with pytest.raises(reshard.ImageRejected, match="below the minimum 65x0") as info:
        reshard.convert(good, FETCH, min_width=65, min_height=0)
    assert info.value.status == "too_small"


def snapshot(root: Path, skip: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` but ``skip``: (size, mtime_ns) — what a stray write would change."""
    return {
        p.relative_to(root).as_posix(): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if skip not in (p, *p.parents)
    }


@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_unsafe_members_duplicates_and_missing_files_are_refused_and_counted(tmp_path):
    meta, out = tmp_path / "meta", tmp_path / "out"
    (meta / "imgs").mkdir(parents=True)
    ok = image_bytes(40, 40, BLUE)
    (tmp_path / "secret.jpg").write_bytes(ok)  # outside the source folder
    (meta / "imgs" / "ok.jpg").write_bytes(ok)
    (meta / "imgs" / "escape.jpg").symlink_to(tmp_path / "secret.jpg")
    with tarfile.open(meta / "000.tgz", "w:gz") as tar:
        add_member(tar, "./000/ok.jpg", ok)
        add_member(tar, "000/sym.jpg", kind=tarfile.SYMTYPE, link="/etc/passwd")
        add_member(tar, "000/hard.jpg", kind=tarfile.LNKTYPE, link="000/ok.jpg")
        add_member(tar, "000/dev.jpg", kind=tarfile.CHRTYPE)
        add_member(tar, "../000/up.jpg", ok)
        add_member(tar, "/000/abs.jpg", ok)
        add_member(tar, "000/twice.jpg", ok)
        add_member(tar, "000/twice.jpg", ok)
        add_member(tar, "root.jpg", ok)  # at the archive's root: serves member 000/root.jpg
    with zipfile.ZipFile(meta / "part.zip", "w") as zf:
        zf.writestr("ok.jpg", ok)
        zf.writestr("../up.jpg", ok)
        link = zipfile.ZipInfo("link.jpg")
        link.external_attr = 0o120777 << 16
        zf.writestr(link, "/etc/passwd")
        zf.writestr("twice.jpg", ok)
        zf.writestr("twice.jpg", ok)
    members = {
        None: ["imgs/ok.jpg", "imgs/escape.jpg", "../secret.jpg", "/etc/hostname", "imgs/absent.jpg"],
        "000.tgz": [
            "000/ok.jpg",
            "000/sym.jpg",
            "000/hard.jpg",
            "000/dev.jpg",
            "000/twice.jpg",
            "000/root.jpg",
            "000/up.jpg",
            "000/abs.jpg",
        ],
        "part.zip": ["ok.jpg", "../up.jpg", "link.jpg", "twice.jpg"],
        "../outside.zip": ["ok.jpg"],
        "absent.tgz": ["x.jpg"],
    }
    rows = [row(a, m, f"caption of {m}", {"n": i}) for a, ms in members.items() for i, m in enumerate(ms)]
    rows.append(row("part.zip", "ok.jpg", "the same row again", {}))
    filtered = tmp_path / "filtered.parquet"
    pl.DataFrame(rows).write_parquet(filtered)  # (write_rows refuses duplicates: this parquet is hand-made)
    before = snapshot(tmp_path, out)
    reshard.run(filtered, meta, out, FETCH.model_copy(update={"shard_size": 100}), "test")
    assert snapshot(tmp_path, out) == before
    # shards: loose + ../outside.zip | 000.tgz | absent.tgz | part.zip (a tar's rows get shards of their own)
    names = [f"{i:05d}{suffix}" for i in range(4) for suffix in (".parquet", ".tar", "_stats.json")]
    assert sorted(p.name for p in out.iterdir()) == names
    table = pl.concat([pl.read_parquet(p) for p in sorted(out.glob("*.parquet"))])
    got = {(a, m): (s, e) for a, m, s, e in table.select("archive", "member", "status", "error_message").iter_rows()}
    expected_status = {
        (None, "imgs/ok.jpg"): "success",
        (None, "imgs/escape.jpg"): "unsafe_member",
        (None, "../secret.jpg"): "unsafe_member",
        (None, "/etc/hostname"): "unsafe_member",
        (None, "imgs/absent.jpg"): "failed_to_download",
        ("000.tgz", "000/ok.jpg"): "success",
        ("000.tgz", "000/sym.jpg"): "unsafe_member",
        ("000.tgz", "000/hard.jpg"): "unsafe_member",
        ("000.tgz", "000/dev.jpg"): "unsafe_member",
        ("000.tgz", "000/twice.jpg"): "duplicate",
        ("000.tgz", "000/root.jpg"): "success",
        ("000.tgz", "000/up.jpg"): "failed_to_download",  # only ../000/up.jpg exists: never matched
        ("000.tgz", "000/abs.jpg"): "failed_to_download",
        ("part.zip", "ok.jpg"): "duplicate",  # the second row; the first is a success
        ("part.zip", "../up.jpg"): "unsafe_member",
        ("part.zip", "link.jpg"): "unsafe_member",
        ("part.zip", "twice.jpg"): "duplicate",
        ("../outside.zip", "ok.jpg"): "unsafe_member",
        ("absent.tgz", "x.jpg"): "failed_to_download",
    }
    assert {k: s for k, (s, _) in got.items()} == expected_status
    assert table.height == len(rows) == 20
    assert (table["status"] == "success").sum() == 4
    assert "symlink" in got["000.tgz", "000/sym.jpg"][1] and "hardlink" in got["000.tgz", "000/hard.jpg"][1]
    assert "outside the source folder" in got[None, "imgs/escape.jpg"][1]
    assert status_totals(out) == {"success": 4, "unsafe_member": 9, "failed_to_download": 4, "duplicate": 3}


def test_truncated_tar_fails_the_rows_it_did_not_reach(tmp_path):
    meta, out = tmp_path / "meta", tmp_path / "out"
    meta.mkdir()
    rng = np.random.default_rng(0)
    noisy = [cv2.imencode(".png", rng.integers(0, 255, (40, 40, 3), dtype=np.uint8))[1].tobytes() for _ in range(6)]
    with tarfile.open(meta / "000.tar", "w") as tar:
        for i, data in enumerate(noisy):
            add_member(tar, f"000/{i}.png", data)
    whole = (meta / "000.tar").read_bytes()
    (meta / "000.tar").write_bytes(whole[: len(whole) // 2])
    filtered = tmp_path / "filtered.parquet"
    write_rows([row("000.tar", f"000/{i}.png", str(i), {}) for i in range(6)], filtered)
    reshard.run(filtered, meta, out, FETCH.model_copy(update={"shard_size": 10}), "test")
    got = pl.read_parquet(out / "00000.parquet").select("member", "status", "error_message").rows()
    assert [s for _, s, _ in got] == ["success"] * 3 + ["failed_to_download"] * 3  # the cut falls in member 3
    assert all("archive unreadable at 000/3.png" in e for _, _, e in got[3:])


def test_bad_filtered_rows_are_named(tmp_path):
    path = tmp_path / "filtered.parquet"
    pl.DataFrame({"archive": ["a.zip"], "member": ["x.png"], "seed": [1]}).write_parquet(path)
    with pytest.raises(InputError, match=r"columns \['caption', 'meta'\] missing"):
        reshard.run(path, tmp_path, tmp_path / "out", FETCH, "test")
    write_rows([row("a.zip", "x.png", "c", {}) | {"meta": "[1]"}], path)
    with pytest.raises(InputError, match=r"row 0 \(member 'x.png'\): meta is not a JSON object"):
        reshard.run(path, tmp_path, tmp_path / "out", FETCH, "test")
    write_rows([row("a.rar", "x.png", "c", {})], path)
    with pytest.raises(InputError, match="archive 'a.rar' is neither a zip nor a tar"):
        reshard.run(path, tmp_path, tmp_path / "out", FETCH, "test")


def mixed_source(meta: Path) -> Path:
    """9 loose files, a zip of 5 and a tgz of 6 (sorted in that order), with captions; return the filtered parquet."""
    colours = [RED, GREEN, BLUE]
    rows = []
    for i in range(9):
        (meta / "loose").mkdir(parents=True, exist_ok=True)
        (meta / "loose" / f"{i}.png").write_bytes(image_bytes(40, 48, colours[i % 3], "PNG"))
        rows.append(row(None, f"loose/{i}.png", f"loose {i}", {"i": i}))
    with zipfile.ZipFile(meta / "part.zip", "w") as zf:
        for i in range(5):
            zf.writestr(f"{i}.jpg", image_bytes(48, 40, colours[i % 3]))
            rows.append(row("part.zip", f"{i}.jpg", f"zip {i}", {"i": i}))
    with tarfile.open(meta / "t00.tgz", "w:gz") as tar:
        for i in reversed(range(6)):  # stream order differs from key order
            add_member(tar, f"000/{i}.jpg", image_bytes(40, 40, colours[i % 3]))
            rows.append(row("t00.tgz", f"000/{i}.jpg", f"tar {i}", {"i": i}))
    write_rows(rows, meta.parent / "filtered.parquet")
    return meta.parent / "filtered.parquet"


def test_plan_puts_each_tar_archive_in_shards_of_its_own(tmp_path):
    filtered = mixed_source(tmp_path / "meta")
    plans = reshard.plan_shards(reshard.load_rows(filtered), 4)
    assert [(p.shard_id, p.archive, len(p.items)) for p in plans] == [
        (0, None, 4),
        (1, None, 4),
        (2, None, 4),  # loose files and zip members fill shards across the boundary
        (3, None, 2),
        (4, "t00.tgz", 4),
        (5, "t00.tgz", 2),
    ]
    assert [i.key for i in plans[4].items] == ["000040", "000041", "000042", "000043"]


def test_resume_redoes_only_incomplete_shards_and_output_is_independent_of_processes(
    tmp_path, tree_digest, monkeypatch
):
    filtered = mixed_source(tmp_path / "meta")
    meta, clean, resumed = tmp_path / "meta", tmp_path / "clean", tmp_path / "resumed"
    reshard.run(filtered, meta, clean, FETCH.model_copy(update={"processes": 2}), "mixed")
    digest = tree_digest(clean)
    reshard.run(filtered, meta, resumed, FETCH, "mixed")
    assert tree_digest(resumed) == digest

    samples = samples_by_member(resumed)
    assert len(samples) == 20 and samples["000/5.jpg"]["txt"] == "tar 5" and samples["000/5.jpg"]["json"]["i"] == 5
    assert close_to(tuple(decode(samples["loose/2.png"]["jpg"])[16, 16]), BLUE)
    assert set(statuses(resumed).values()) == {"success"}

    # a killed run: shard 1's stats gone and its tar truncated, shard 5 without stats, temporaries left
    (resumed / "00001_stats.json").unlink()
    (resumed / "00001.tar").write_bytes((resumed / "00001.tar").read_bytes()[:700])
    (resumed / "00005_stats.json").unlink()
    (resumed / ".00002.tar.x1y2.tmp").write_bytes(b"partial")
    (resumed / "00009.tar").write_bytes(b"stale")
    kept = {
        p.name: (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in resumed.iterdir()
        if p.name[:5] in ("00000", "00002", "00003", "00004")
    }
    converted = []
    real_convert = reshard.convert
    monkeypatch.setattr(reshard, "convert", lambda data, *a, **kw: converted.append(1) or real_convert(data, *a, **kw))
    reshard.run(filtered, meta, resumed, FETCH, "mixed")
    assert len(converted) == 4 + 2  # shard 1 (4 rows) and shard 5 (2 rows) only
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in resumed.iterdir() if p.name in kept} == kept
    assert tree_digest(resumed) == digest
    assert not [p for p in resumed.iterdir() if ".tmp" in p.name or p.name.startswith("00009")]

    converted.clear()
    reshard.run(filtered, meta, resumed, FETCH, "mixed")  # complete: nothing to do
    assert converted == [] and tree_digest(resumed) == digest
    assert len(list(resumed.glob("*_stats.json"))) == 6
    assert json.loads((resumed / "00005_stats.json").read_text())["status_dict"] == {"success": 2}
