"""Symlink loops in a data folder (issue 39, case 4): a link that never ends is counted like one pointing
nowhere — the source's other files are kept — instead of ``RuntimeError: Symlink loop``."""

from __future__ import annotations

import os

import polars as pl

from sdforge.bounds.paths import resolved, resolves_inside, resolves_to_file
from sdforge.config import FilterRules, LocalOptions, Source
from sdforge.ingest.sources.local import filter_local
from sdforge.preflight.samples import write_files
from stages import download_metadata
from tests.fixtures.sources import BLUE, RED, image_bytes


def _loop(folder, a: str, b: str) -> None:
    os.symlink(b, folder / a)
    os.symlink(a, folder / b)


def test_a_loop_resolves_to_nothing(tmp_path):
    _loop(tmp_path, "a.jpg", "b.jpg")
    (tmp_path / "c.jpg").write_bytes(b"c")
    assert resolved(tmp_path / "a.jpg") is None
    assert not resolves_inside(tmp_path / "a.jpg", tmp_path) and not resolves_to_file(tmp_path / "b.jpg")
    assert resolves_inside(tmp_path / "c.jpg", tmp_path) and resolves_to_file(tmp_path / "c.jpg")


def test_download_metadata_skips_a_symlink_loop_and_copies_the_rest(tmp_path, caplog):
    repo = tmp_path / "repo"
    write_files(repo, {"good.png": image_bytes(40, 40, RED, "PNG"), "good.txt": "a red square"})
    _loop(repo, "a.png", "b.png")
    source = Source(kind="local", repo=str(repo), allow_patterns=["*.png", "*.txt"])
    metrics = download_metadata.run(source, tmp_path / "meta")
    assert sorted(p.name for p in (tmp_path / "meta").iterdir()) == ["good.png", "good.txt"]
    assert metrics["skipped_symlinks"] == 2 and "a.png -> b.png" in caplog.text


def test_filter_counts_a_symlink_loop_as_an_unsafe_member_and_keeps_the_rest(tmp_path):
    meta = tmp_path / "meta"
    write_files(meta, {"good.png": image_bytes(40, 40, BLUE, "PNG"), "good.txt": "a blue square", "a.txt": "loop"})
    _loop(meta, "a.png", "b.png")
    metrics = filter_local(meta, tmp_path / "out.parquet", LocalOptions(), FilterRules())
    assert (metrics["rows_in"], metrics["dropped_unsafe_member"], metrics["rows_out"]) == (3, 2, 1)
    assert pl.read_parquet(tmp_path / "out.parquet")["caption"].to_list() == ["a blue square"]
