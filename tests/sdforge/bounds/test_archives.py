"""Compressed side files within bounds (issue 39, case 3): a DiffusionDB part whose JSON member is a zip bomb
costs that part; a gzip-bombed JourneyDB annotation archive stops after a bounded read with an error naming it
and the keys; a JSON line with no end is skipped with a bounded buffer and counted."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import resource
import tarfile
import zipfile

import polars as pl
import pytest

from sdforge.bounds.archives import MIN_INFLATED_BYTES, bounded_lines, inflate_limit
from sdforge.config import FilterRules, InputLimits, JourneyDbOptions
from sdforge.ingest.archive_members import stream_tar
from sdforge.ingest.sources.diffusiondb import filter_diffusiondb
from sdforge.ingest.sources.journeydb import filter_journeydb
from sdforge.io import InputError
from sdforge.preflight.samples import journeydb_record, write_journeydb
from tests.fixtures.sources import RED, image_bytes

BOMB_BYTES = 160 << 20
"""What each bomb inflates to: 2.5× the 64 MiB a small file may always inflate to, from ~160 KB."""


class Zeros(io.RawIOBase):
    """``n`` zero bytes, streamed (the test never holds the bomb)."""

    def __init__(self, n: int):
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_the_inflate_limit_is_the_ratio_with_a_floor_and_a_ceiling():
    limits = InputLimits(archive_max_ratio=100, archive_max_bytes=1 << 30)
    assert inflate_limit(1_000, limits) == MIN_INFLATED_BYTES
    assert inflate_limit(5 << 20, limits) == 500 << 20
    assert inflate_limit(50 << 20, limits) == 1 << 30


def test_diffusiondb_a_zip_bomb_json_member_costs_its_part_only(tmp_path, caplog):
    meta = tmp_path / "meta"
    meta.mkdir()
    entry = {"p": "a prompt", "se": 1}
    with zipfile.ZipFile(meta / "part-000001.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("a.png", b"a")
        zf.writestr("part-000001.json", json.dumps({"a.png": entry}))
    with zipfile.ZipFile(meta / "part-000002.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("b.png", b"b")
        with zf.open("part-000002.json", "w") as member:  # streamed: ~160 KB on disk
            stream = Zeros(BOMB_BYTES)
            while chunk := stream.read(1 << 20):
                member.write(chunk)
    rss0 = _rss_mib()
    metrics = filter_diffusiondb(meta, tmp_path / "out.parquet", FilterRules())
    assert _rss_mib() - rss0 < 50  # the member was never inflated
    assert (metrics["rows_in"], metrics["dropped_bad_metadata"], metrics["rows_out"]) == (2, 1, 1)
    assert pl.read_parquet(tmp_path / "out.parquet")["member"].to_list() == ["a.png"]
    assert "part-000002.json: inflates" in caplog.text and "archive_max_ratio 100" in caplog.text


def test_journeydb_a_gzip_bombed_annotation_archive_stops_with_a_named_error(tmp_path):
    repo = tmp_path / "repo"
    write_journeydb(repo, {"000": {"aaa.jpg": image_bytes(40, 40, RED)}}, [journeydb_record("./000/aaa.jpg", "red")])
    bomb = repo / "data" / "train" / "train_anno_realease_repath.jsonl.tgz"
    with gzip.open(bomb, "wb") as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        info = tarfile.TarInfo("train_anno_realease_repath.jsonl")
        info.size = BOMB_BYTES
        tar.addfile(info, Zeros(BOMB_BYTES))
    assert bomb.stat().st_size < 1 << 20
    rss0 = _rss_mib()
    with pytest.raises(InputError, match=r"jsonl\.tgz: inflates past 67,108,864 bytes .*archive_max_ratio 100"):
        filter_journeydb(repo, tmp_path / "out.parquet", JourneyDbOptions(), FilterRules())
    assert _rss_mib() - rss0 < 100  # a bounded buffer, not the 160 MiB line


def test_a_line_with_no_end_is_skipped_in_bounded_chunks_and_counted(tmp_path):
    stream = io.BytesIO(b'{"a": 1}\n' + b"x" * 5000 + b"\n\n" + b'{"b": 2}\n' + b"y" * 3000)
    assert list(bounded_lines(stream, 1000)) == [b'{"a": 1}\n', None, b'{"b": 2}\n', None]
    repo = tmp_path / "repo"
    long_line = json.dumps(journeydb_record("./000/bbb.jpg", "x" * 3000))
    write_journeydb(repo, {"000": {"aaa.jpg": image_bytes(40, 40, RED), "bbb.jpg": image_bytes(40, 40, RED)}},
                    [long_line, journeydb_record("./000/aaa.jpg", "red")])  # fmt: skip
    limits = InputLimits(json_max_bytes=1000)
    metrics = filter_journeydb(repo, tmp_path / "out.parquet", JourneyDbOptions(), FilterRules(), limits)
    assert (metrics["rows_in"], metrics["dropped_json_too_large"], metrics["rows_out"]) == (2, 1, 1)


class _Zeros(io.RawIOBase):
    """``n`` zero bytes, as a readable stream (a huge member compresses to almost nothing)."""

    def __init__(self, n: int):
        self.left = n

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n


@pytest.mark.parametrize("opener", [gzip.open, bz2.open, lzma.open, open])
def test_a_huge_tar_member_before_a_good_one_is_skipped_unheld_and_the_good_one_kept(tmp_path, opener):
    """Issue 39, case 6: a 10 GiB member (~10 MB compressed) before a good image in a JourneyDB archive took
    fetch_images 9 min 26 s; skipped through the C-level decompressors it takes 12.9 s (2-core Xeon, gzip). Here
    64 MiB, every compression the stream reader accepts."""
    path = tmp_path / "000.tar"
    with opener(path, "wb") as fh, tarfile.open(fileobj=fh, mode="w|") as tar:
        info = tarfile.TarInfo("000/big.jpg")
        info.size = 64 << 20
        tar.addfile(info, io.BufferedReader(_Zeros(info.size), 1 << 20))
        info = tarfile.TarInfo("000/good.jpg")
        info.size = 6
        tar.addfile(info, io.BytesIO(b"\xff\xd8good"))
    out = dict(stream_tar(path, "000.tar", {"000/big.jpg": 0, "000/good.jpg": 1}, max_bytes=1 << 20))
    assert out["000/big.jpg"].status == "too_large" and out["000/good.jpg"] == b"\xff\xd8good"
