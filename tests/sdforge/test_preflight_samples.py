"""sdforge.preflight.samples: a sample of each FULL-config source runs through the real data stages.

Every value of ``configs/full/params.yaml`` is kept (filter thresholds, patterns, columns, options) except
``fetch.image_size`` (64, to stay fast), ``fetch.processes`` (1) and, for ``laion``, ``allow_networks``
(the loopback server).
"""

from __future__ import annotations

import copy
import io
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from sdforge.config import Source
from sdforge.demo.http_server import serve_directory
from sdforge.ingest import shards
from sdforge.preflight.samples import write_sample_source
from tests.fixtures.sources import run_source

REPO = Path(__file__).resolve().parents[2]
SIZE, N = 64, 3


@cache
def full_sources() -> dict[str, dict]:
    return yaml.safe_load((REPO / "configs" / "full" / "params.yaml").read_text())["sources"]


def sample_params(name: str) -> dict:
    """The full config's source ``name`` with the test's fetch overrides, every other value as configured."""
    raw = copy.deepcopy(full_sources()[name])
    raw["fetch"] = {**raw.get("fetch", {}), "image_size": SIZE, "processes": 1}
    if raw["kind"] == "laion":
        raw["fetch"]["allow_networks"] = ["127.0.0.0/8"]
    return raw


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> tuple[Path, str]:
    http_dir = tmp_path_factory.mktemp("http")
    with serve_directory(http_dir, port=0) as url_base:
        yield http_dir, url_base


def test_the_full_config_has_every_kind_the_test_expects():
    assert {s["kind"] for s in full_sources().values()} == {"laion", "diffusiondb", "journeydb", "vggface2", "coco"}


@pytest.mark.parametrize("name", list(full_sources()))
def test_sample_passes_the_full_filter_and_fetches(name, server, tmp_path):
    raw, (http_dir, url_base) = sample_params(name), server
    written = write_sample_source(name, raw, tmp_path / "repo", http_dir, url_base, N, seed=0)
    assert written["kind"] == raw["kind"] and written["items"] == N and written["files"] >= 1
    assert written["image_size"] >= SIZE
    source = Source.model_validate({**raw, "repo": str(tmp_path / "repo")})
    filter_metrics, fetch_metrics, out = run_source(source, name, tmp_path / "work")
    assert filter_metrics["rows_out"] == N, filter_metrics
    assert not {k: v for k, v in filter_metrics.items() if k.startswith("dropped_") and v}, filter_metrics
    assert (fetch_metrics["samples"], fetch_metrics["successes"]) == (N, N), fetch_metrics
    samples = [sample for _, sample in shards.iter_samples(out)]
    assert len(samples) == N
    captions, pixels = [], []
    for sample in samples:
        image = Image.open(io.BytesIO(sample["jpg"]))
        assert (image.format, image.mode, image.size) == ("JPEG", "RGB", (SIZE, SIZE))
        captions.append(sample["txt"].decode().strip())
        pixels.append(np.asarray(image, np.float32))
    assert all(captions)
    if raw["kind"] != "vggface2":  # its captions are templates
        assert len(set(captions)) == N
    assert all(p.std() > 10 for p in pixels), "not a solid colour"
    assert all(np.abs(a - b).mean() > 5 for i, a in enumerate(pixels) for b in pixels[i + 1 :]), "images repeat"


@pytest.mark.parametrize("mode", ["txt", "json"])
def test_local_sample_passes_its_rules(mode, tmp_path):
    local = {"mode": mode, "min_score": 5.0, "tag_score_bonus": {"photo": -3.0}, "exclude_tags": ["red circle"]}
    raw = {"kind": "local", "repo": "x", "allow_patterns": ["sample-*"], "local": local, "filter": {"min_width": 80}}
    raw["fetch"] = {"image_size": SIZE}
    written = write_sample_source("mine", raw, tmp_path / "repo", tmp_path / "http", "", N, seed=3)
    assert written == {"kind": "local", "items": N, "files": 2 * N, "image_size": 80}
    source = Source.model_validate({**raw, "repo": str(tmp_path / "repo")})
    filter_metrics, fetch_metrics, out = run_source(source, "mine", tmp_path / "work")
    assert (filter_metrics["rows_out"], fetch_metrics["successes"]) == (N, N), (filter_metrics, fetch_metrics)
    assert all(sample["txt"].strip() for _, sample in shards.iter_samples(out))


def test_same_seed_same_bytes_other_seed_other_images(tmp_path):
    def files(folder: str, seed: int) -> dict[str, bytes]:
        write_sample_source("journeydb", sample_params("journeydb"), tmp_path / folder, tmp_path, "", 2, seed)
        return {p.relative_to(tmp_path / folder).as_posix(): p.read_bytes() for p in (tmp_path / folder).rglob("*.*")}

    first, again, other = files("a", 7), files("b", 7), files("c", 8)
    assert first == again
    assert first.keys() == other.keys() and first != other


def test_patterns_that_miss_the_layout_are_an_error(tmp_path):
    raw = {**sample_params("coco"), "allow_patterns": ["annotations/*.json"]}
    with pytest.raises(ValueError, match=r"sources\.coco: .*miss the coco sample files .*train2017/000000000001\.jpg"):
        write_sample_source("coco", raw, tmp_path / "repo", tmp_path / "http", "", 1, 0)


def test_unknown_kind_names_the_source_and_the_writable_kinds(tmp_path):
    raw = {**sample_params("laion"), "kind": "webvid"}
    with pytest.raises(ValueError, match=r"sources\.clips: kind 'webvid' .*laion, diffusiondb, journeydb"):
        write_sample_source("clips", raw, tmp_path / "repo", tmp_path / "http", "http://127.0.0.1:1", 3, 0)
