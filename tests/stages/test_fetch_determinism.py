"""fetch_images is a pure function of its inputs: hostile inputs fetched twice give the same bytes (issue 14, item 6).

Error messages (the parquet's ``error_message``, img2dataset's ``status_dict``) must carry no memory
addresses, timestamps or temp paths, for every source kind: DVC hashes the shard folder.
"""

from __future__ import annotations

import io
import json
import re
import socket
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from sdforge.config import FetchSettings, Source
from sdforge.demo.http_server import serve_directory
from sdforge.ingest import shards
from stages import download_metadata, fetch_images, filter_metadata
from tests.fixtures.sources import GREEN, RED, image_bytes, write_files

ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def _encoded(fmt: str, size: tuple[int, int] = (24, 24)) -> bytes:
    """A blue image of ``size`` encoded as ``fmt``."""
    buf = io.BytesIO()
    Image.new("RGB", size, (30, 60, 200)).save(buf, fmt)
    return buf.getvalue()


def _closed_port() -> int:
    """A loopback port nothing listens on (connections to it are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``: relative path → bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _assert_same_bytes(first: Path, second: Path) -> None:
    """The two folders hold the same files with the same bytes (the differing messages shown if not)."""
    a, b = _tree(first), _tree(second)
    assert sorted(a) == sorted(b)
    differ = [name for name in a if a[name] != b[name]]
    if differ:
        parquets = [name for name in differ if name.endswith(".parquet")]
        messages = [
            sorted(pl.read_parquet(f / n)["error_message"].drop_nulls()) for n in parquets for f in (first, second)
        ]
        pytest.fail(f"{differ} differ between two fetches of the same inputs; messages: {messages}")


def _messages(folder: Path) -> dict[str, str | None]:
    """``{caption: error_message}`` over every shard parquet of ``folder``."""
    table = pl.concat([pl.read_parquet(p) for p in sorted(folder.glob("*.parquet"))], how="diagonal")
    column = "caption" if "member" not in table.columns else "member"
    return dict(table.select(column, "error_message").iter_rows())


def _assert_clean(folder: Path, tmp_path: Path) -> None:
    """No address, no temp path, in the parquets nor in the stats."""
    texts = [m or "" for m in _messages(folder).values()]
    texts += [key for p in folder.glob("*_stats.json") for key in json.loads(p.read_text())["status_dict"]]
    for text in texts:
        assert not ADDRESS.search(text), text
        assert str(tmp_path) not in text, text


def test_url_fetch_of_hostile_inputs_twice_is_byte_identical(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    www = tmp_path / "www"
    write_files(
        www,
        {
            "good.jpg": _encoded("JPEG"),
            "good.png": _encoded("PNG"),
            "truncated.jpg": _encoded("JPEG", (300, 300))[:400],
            "truncated.png": _encoded("PNG", (300, 300))[:200],
            "text.jpg": "hello, not an image",
            "zero.jpg": b"",
        },
    )
    closed = _closed_port()
    redirects = {
        "/to-good": "/good.jpg",
        "/to-closed": f"http://127.0.0.1:{closed}/x.jpg",
        "/to-metadata": "http://169.254.169.254/latest/meta-data/",
        "/to-file": (tmp_path / "secret.jpg").as_uri(),
        "/loop": "/loop",
    }
    fetch = FetchSettings(image_size=16, processes=1, threads=4, timeout=5, retries=0, allow_networks=["127.0.0.0/8"])
    source = Source(kind="laion", repo="unused", fetch=fetch)
    with serve_directory(www, 0, redirects=redirects, errors={"/boom": 500}) as base:
        names = [p.name for p in sorted(www.iterdir())] + ["missing.jpg", "boom", *(p[1:] for p in redirects)]
        rows = [(f"{base}/{name}", name) for name in names]
        rows += [(f"http://127.0.0.1:{closed}/x.jpg", "closed port"), ("http://10.0.0.1/x.jpg", "private")]
        rows += [("file:///etc/passwd", "file"), ("www/good.jpg", "no scheme")]
        filtered = tmp_path / "filtered"
        filtered.mkdir()
        pl.DataFrame({"url": [u for u, _ in rows], "caption": [c for _, c in rows]}).write_parquet(
            filtered / "filtered.parquet"
        )
        metrics = [fetch_images.run(source, "h", filtered, tmp_path, tmp_path / f"out{i}") for i in (1, 2)]
    assert metrics[0] == metrics[1]
    assert metrics[0]["successes"] == 3 and metrics[0]["samples"] == len(rows)
    _assert_same_bytes(tmp_path / "out1", tmp_path / "out2")
    _assert_clean(tmp_path / "out1", tmp_path)
    messages = _messages(tmp_path / "out1")
    assert messages["missing.jpg"] == "HTTP Error 404: File not found"  # informative as before
    assert "Connection refused" in messages["closed port"] and "Connection refused" in messages["to-closed"]
    assert "refused address" in messages["to-metadata"] and "refused scheme" in messages["to-file"]


def test_local_fetch_of_hostile_inputs_twice_is_byte_identical(tmp_path):
    """Files that changed after the filter (PIL's error names an in-memory file by its address)."""
    repo = tmp_path / "repo"
    files = {f"{c}.jpg": image_bytes(40, 40, RED) for c in "abcde"} | {f"{c}.txt": f"caption {c}" for c in "abcde"}
    write_files(repo, files | {"f.png": image_bytes(40, 40, GREEN, "PNG"), "f.txt": "f"})
    source = Source(kind="local", repo=str(repo), allow_patterns=["*"], fetch={"image_size": 32, "shard_size": 4})
    meta, filtered = tmp_path / "metadata", tmp_path / "filtered"
    download_metadata.run(source, meta)
    filter_metadata.run(source, "local", meta, filtered)
    (meta / "b.jpg").write_bytes(b"not an image at all")
    (meta / "c.jpg").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    (meta / "d.jpg").unlink()
    (meta / "e.jpg").write_bytes(b"")
    (meta / "f.png").write_bytes(image_bytes(40, 40, GREEN, "PNG")[:60])
    metrics = [fetch_images.run(source, "local", filtered, meta, tmp_path / f"out{i}") for i in (1, 2)]
    assert metrics[0] == metrics[1] and metrics[0]["successes"] == 1
    _assert_same_bytes(tmp_path / "out1", tmp_path / "out2")
    _assert_clean(tmp_path / "out1", tmp_path)
    messages = _messages(tmp_path / "out1")
    unidentified = "not a readable image (UnidentifiedImageError: cannot identify image file <_io.BytesIO object>)"
    assert messages["b.jpg"] == unidentified
    assert messages["d.jpg"] == "file d.jpg not found"


def _raw_shard(folder: Path, address: str, run_dir: str, when: str) -> None:
    """An img2dataset shard as a worker leaves it, its error messages naming run-dependent things."""
    folder.mkdir()
    messages = [
        None,
        f"HTTPConnectionPool(host='h', port=80): Max retries exceeded (Caused by NewConnectionError("
        f"'<urllib3.connection.HTTPConnection object at {address}>: Failed to establish a new connection'))",
        f"[Errno 13] Permission denied: '{run_dir}/metadata/b.jpg'",
        f"certificate has expired ({when})",
        f"cannot identify image file <_io.BytesIO object at {address}>",
        f"cannot identify image file <_io.BytesIO object at {address[:-1]}1>",
    ]
    keys = [f"0000{i}" for i in range(len(messages))][::-1]
    status = ["success" if m is None else "failed_to_download" for m in messages]
    table = pa.table({"key": keys, "status": status, "error_message": messages})
    pq.write_table(table, folder / "00000.parquet")
    (folder / "00000.tar").write_bytes(shards.tar_bytes([{"__key__": keys[0], "txt": "c", "json": "{}"}]))
    status_dict = {"success": 1} | {m: 1 for m in messages if m}
    stats = {"count": 6, "successes": 1, "failed_to_download": 5, "failed_to_resize": 0, "status_dict": status_dict}
    (folder / "00000_stats.json").write_text(json.dumps({**stats, "start_time": 1.0, "end_time": 2.0, "duration": 1}))


def test_canonicalize_folder_sanitises_every_error_message(tmp_path):
    _raw_shard(tmp_path / "a", "0x7f3a12345670", "/tmp/tmpk2j3h4g5", "2024-05-01T12:00:03Z")
    _raw_shard(tmp_path / "b", "0x55d2c0ffee00", "/tmp/pytest-of-u/pytest-9/test0", "2025-11-30 23:59:59.5+01:00")
    for folder in ("a", "b"):
        shards.canonicalize_folder(tmp_path / folder)
    _assert_same_bytes(tmp_path / "a", tmp_path / "b")
    stats = json.loads((tmp_path / "a" / "00000_stats.json").read_text())
    assert stats["status_dict"]["cannot identify image file <_io.BytesIO object>"] == 2  # merged
    assert "[Errno 13] Permission denied: '<tmp>/b.jpg'" in stats["status_dict"]
    assert "certificate has expired (<time>)" in stats["status_dict"]
    assert sum(stats["status_dict"].values()) == stats["count"]


@pytest.mark.parametrize(
    "message",
    [
        None,
        "HTTP Error 404: File not found",
        "<urlopen error [Errno 111] Connection refused>",
        "OpenCV(5.0.0) /io/opencv/modules/imgcodecs/src/loadsave.cpp:1291: error: (-215:Assertion failed)",
        "refused scheme 'file' (only http and https are fetched) in a redirect from http://127.0.0.1:34991/tmp/x",
        "bad CRC 0xdeadbeef at byte 0xff",
        "file:///tmp/secret.jpg",
    ],
)
def test_deterministic_messages_are_left_as_they_are(message):
    assert shards.sanitize_error_message(message) == message


def test_error_messages_become_one_bounded_line():
    """OpenCV's assertion text for a 0-byte image (what img2dataset stored) and a server's multi-line reason."""
    opencv = (
        "OpenCV(4.10.0) /io/opencv/modules/imgcodecs/src/loadsave.cpp:1019: error: (-215:Assertion failed) "
        "!buf.empty() in function 'imdecode_'\n\n"
    )
    assert shards.sanitize_error_message(opencv) == opencv.strip()
    assert shards.sanitize_error_message("HTTP Error 500: boom\r\n  at line 2\tand 3") == (
        "HTTP Error 500: boom at line 2 and 3"
    )
    long = shards.sanitize_error_message("x " * 5000)
    assert len(long) == shards.MAX_ERROR_CHARS + 1 and long.endswith("…") and "\n" not in long
    assert shards.sanitize_error_message(long) == long


def test_sanitize_error_message_is_idempotent():
    message = "at 0x7f00aa12bc34, '/tmp/tmpab12cd_e/x.jpg' on Wed, 01 May 2024 12:00:03 GMT (<f at 0x7f>)"
    once = shards.sanitize_error_message(message)
    assert once == "at <address>, '<tmp>/x.jpg' on <time> (<f>)"
    assert shards.sanitize_error_message(once) == once
