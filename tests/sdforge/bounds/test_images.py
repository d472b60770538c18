"""Image bounds on a re-read (issue 39, cases 5 and 6): ``caption_images`` and ``encode_latents`` apply
``fetch.max_image_pixels`` to the shards they decode — a header declaring a bomb is skipped before any pixel is
decoded, a very thin image before its resize — and count both as ``too_large``; the samples beside them are
kept."""

from __future__ import annotations

import io
import resource
import zlib
from collections import Counter

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from sdforge.bounds.images import ImageRejected, check_header
from sdforge.captions.report import _to_image
from sdforge.captions.shards import Captioning, caption_shards
from sdforge.ingest.shards import tar_bytes
from sdforge.latents.inputs import decode_chunk, decode_sample, iter_tar_groups
from tests.fixtures.sources import RED, image_bytes, png_header

MAX_PIXELS = 89_478_485  # fetch.max_image_pixels' default
BOMB = png_header(30_000, 30_000, idat=zlib.compress(b"\0" * 30_001 * 64))
"""A PNG whose header declares 30000×30000 (900 M pixels; ~2.7 GB decoded) in a few hundred bytes."""


def _thin_png(width: int = 999_000) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((1, width), 200, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def test_check_header_reads_the_declared_size_only():
    with pytest.raises(ImageRejected, match=r"30000x30000 = 900000000 pixels > fetch.max_image_pixels 89478485"):
        check_header(BOMB, MAX_PIXELS)
    check_header(image_bytes(40, 40, RED, "PNG"), MAX_PIXELS)  # passes
    check_header(b"not an image", MAX_PIXELS)  # unreadable headers are the decoder's to report


def test_encode_skips_a_bomb_and_a_thin_image_as_too_large_and_keeps_the_rest():
    good = {"png": image_bytes(40, 40, RED, "PNG"), "txt": b"a red square"}
    chunk = [("000000000", {"png": BOMB, "txt": b"bomb"}), ("000000001", good),
             ("000000002", {"png": _thin_png(), "txt": b"thin"})]  # fmt: skip
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = decode_chunk(chunk, [(32, 32)], "resize", None, MAX_PIXELS)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert [s.problem for s in out] == ["too_large", None, "too_large"]
    assert out[1].image is not None and out[1].image.shape == (32, 32, 3) and out[1].caption == "a red square"
    assert grown_mib < 200, f"decoding grew the process by {grown_mib:.0f} MiB"


def test_without_a_limit_a_thin_image_is_still_decoded_as_before():
    sample = decode_sample("k", {"png": _thin_png(2_000), "txt": b"t"}, [(32, 32)])
    assert sample.problem is None and sample.image.shape == (32, 32, 3)


def test_caption_images_skips_a_bomb_and_a_thin_image_and_captions_the_rest(tmp_path):
    """Issue 39, case 5: the recaption stage reads the fetched shards with the fetch stage's bound."""
    shards, out = tmp_path / "shards", tmp_path / "captions"
    shards.mkdir()
    samples = [
        {"__key__": "000000000", "png": BOMB, "txt": "bomb"},
        {"__key__": "000000001", "png": image_bytes(40, 40, RED, "PNG"), "txt": "good"},
        {"__key__": "000000002", "png": _thin_png(1_000_000), "txt": "thin"},
    ]
    (shards / "00000.tar").write_bytes(tar_bytes(samples))
    asked = []

    def generate(images):
        asked.extend(img.shape for img in images)
        return ["a red square"] * len(images)

    run = Captioning("scripted", None, "fp", "a photo of", generate, lambda t: 3, max_pixels=MAX_PIXELS)
    stats = caption_shards(shards, out, run)
    rows = pq.read_table(out / "00000.parquet").to_pylist()
    assert asked == [(40, 40, 3)] and stats.rejected == {"too_large": 2}
    assert [(r["rejected"], r["synthetic_caption"]) for r in rows] == [
        ("too_large", "bomb"), (None, "a red square"), ("too_large", "thin")]  # fmt: skip


def test_encode_reads_an_image_member_larger_than_any_allowed_image_only_to_its_bound():
    """Issue 39, case 6: a tar member bigger than ``max_pixels × 8`` bytes is kept only to that bound (the rest is
    read through, never held) and the sample is ``too_large``; the member after it is read whole."""
    max_pixels = 64 * 64
    samples = [{"__key__": "0", "png": b"\x89PNG" + bytes(200 << 20), "txt": "huge"},
               {"__key__": "1", "png": image_bytes(40, 40, RED, "PNG"), "txt": "good"}]  # fmt: skip
    groups = list(iter_tar_groups(io.BytesIO(tar_bytes(samples)), Counter(), 4096, max_pixels))
    assert [(k, len(f["png"])) for k, f in groups] == [("0", max_pixels * 8 + 1), ("1", len(samples[1]["png"]))]
    out = decode_chunk(groups, [(32, 32)], "resize", None, max_pixels)
    assert [s.problem for s in out] == ["too_large", None]


def test_the_mlflow_caption_table_shows_a_placeholder_for_a_bomb_not_a_traceback():
    """The recaption stage's MLflow sample table decodes shard images too: a header over the bound is not
    decoded (PIL itself raises DecompressionBombError, not an OSError, at twice its default)."""
    bomb = _to_image({"png": BOMB})
    good = _to_image({"png": image_bytes(40, 40, RED, "PNG")})
    assert (bomb.size, good.size, good.getpixel((0, 0))) == ((1, 1), (40, 40), RED)
