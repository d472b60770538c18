"""Credentials in metadata URLs: filter_metadata stores them redacted and counts them; fetch_images never sends
them, and refuses a filtered.parquet that still holds some (:mod:`sdforge.ingest.url_credentials`; its unit tests
are tests/sdforge/ingest/test_url_credentials.py)."""

from __future__ import annotations

import collections

import polars as pl
import pyarrow.parquet as pq
import pytest

from sdforge.config import FetchSettings, FilterRules, Source
from sdforge.demo.http_server import serve_directory
from sdforge.ingest import shards
from sdforge.io import InputError
from stages import fetch_images, filter_metadata
from tests.fixtures.sources import image_bytes

SECRET = "s3cr3t-Pa55"
FETCH = FetchSettings(image_size=16, processes=1, threads=2, timeout=5, retries=0, allow_networks=["127.0.0.0/8"])


def laion_parquet(path, urls: list[str]) -> None:
    """LAION metadata: the URLs, a caption each, and the two scores the filter's histograms read."""
    n = len(urls)
    table = {"URL": urls, "TEXT": [f"caption {i}" for i in range(n)], "similarity": [0.3] * n}
    pl.DataFrame(table | {"AESTHETIC_SCORE": [6.0] * n}).write_parquet(path)


def test_credentials_are_stored_redacted_counted_and_never_sent(tmp_path):
    www = tmp_path / "www"
    www.mkdir()
    (www / "good.jpg").write_bytes(image_bytes(24, 24))
    (www / "other.jpg").write_bytes(image_bytes(24, 24))
    hits: collections.Counter[str] = collections.Counter()
    with serve_directory(www, 0, hits=hits) as base:
        host = base.removeprefix("http://")
        urls = [f"http://user:{SECRET}@{host}/good.jpg", f"http://{SECRET}@{host}/other.jpg", f"{base}/good.jpg?2"]
        meta = tmp_path / "meta"
        meta.mkdir()
        laion_parquet(meta / "part-0.parquet", urls)
        source = Source(kind="laion", repo="unused", filter=FilterRules(dedup_hash=False), fetch=FETCH)
        filtered = tmp_path / "filtered"
        metrics = filter_metadata.run(source, "laion", meta, filtered)
        stored = pl.read_parquet(filtered / "filtered.parquet")["url"].to_list()
        assert stored == [f"http://***@{host}/good.jpg", f"http://***@{host}/other.jpg", f"{base}/good.jpg?2"]
        assert metrics["urls_credentials_redacted"] == 2 and metrics["rows_out"] == 3

        fetched = fetch_images.run(source, "laion", filtered, meta, tmp_path / "shards")
    assert fetched["successes"] == 3  # requested without the userinfo (urllib took "user:pw@host" for a host name)
    assert hits["/good.jpg"] == 2 and hits["/other.jpg"] == 1  # "?2" is the same path
    shard_urls = pq.read_table(tmp_path / "shards" / "00000.parquet")["url"].to_pylist()
    assert sorted(shard_urls) == sorted(stored)
    for key, sample in shards.iter_samples(tmp_path / "shards"):
        assert SECRET.encode() not in sample["json"], key
    for folder in (filtered, tmp_path / "shards"):
        for path in folder.rglob("*"):
            assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


def test_fetch_refuses_a_filtered_parquet_that_still_holds_credentials(tmp_path):
    filtered = tmp_path / "filtered"
    filtered.mkdir()
    urls = ["http://127.0.0.1:9/a.jpg", f"http://user:{SECRET}@127.0.0.1:9/b.jpg"]
    pl.DataFrame({"url": urls, "caption": ["a", "b"]}).write_parquet(filtered / "filtered.parquet")
    source = Source(kind="laion", repo="unused", fetch=FETCH)
    with pytest.raises(InputError, match=r"1 URL\(s\) carry credentials .*run filter_metadata again"):
        fetch_images.run(source, "laion", filtered, tmp_path, tmp_path / "shards")
    assert not (tmp_path / "shards").exists()  # refused before the output folder is touched


def test_the_filter_keeps_an_at_sign_in_a_path_and_counts_nothing(tmp_path):
    meta = tmp_path / "meta"
    meta.mkdir()
    urls = ["https://medium.com/@someone/a.jpg", "http://h.com/b.jpg"]
    laion_parquet(meta / "part-0.parquet", urls)
    source = Source(kind="laion", repo="unused", filter=FilterRules(dedup_hash=False))
    metrics = filter_metadata.run(source, "laion", meta, tmp_path / "filtered")
    assert metrics["urls_credentials_redacted"] == 0
    assert pl.read_parquet(tmp_path / "filtered" / "filtered.parquet")["url"].to_list() == urls
