"""sdforge.ingest.image_convert: the resized size is bounded, every library error is a counted rejection (issue 14).

Regression tests for the thin-image blow-up (a 1×N image resized to cover the target), then a property test
(``hypothesis``) of the whole image path: random sizes from 1 px to very thin/wide, modes, bit depths, formats,
truncations and lying headers through :func:`~sdforge.ingest.image_convert.convert`, which must return a bounded
image or raise :class:`~sdforge.ingest.sources.images.ImageRejected`, nothing else, within a memory ceiling. The
default suite runs a bounded number of examples; ``-m slow`` runs many more.
"""

from __future__ import annotations

import io
import json
import resource
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from sdforge.config import FetchSettings
from sdforge.ingest import image_convert, reshard
from sdforge.ingest.image_convert import convert
from sdforge.ingest.sources.images import ImageRejected, decode_rgb
from sdforge.ingest.sources.rows import row, write_rows
from tests.fixtures.sources import (
    BLUE,
    RED,
    close_to,
    decode,
    image_bytes,
    png_header,
    samples_by_member,
    status_totals,
    statuses,
)

STATUSES = {"failed_to_resize", "too_large", "too_small"}
JPEG_MAX_SIDE = 65_500
"""The longest side OpenCV's JPEG encoder accepts."""
REPO = Path(__file__).resolve().parents[3]


def png(w: int, h: int, mode: str = "L") -> bytes:
    """A ``w``×``h`` PNG of one grey level (a 1×2,000,000 one is about 4 KB)."""
    buf = io.BytesIO()
    Image.new(mode, (w, h), 128).save(buf, "PNG")
    return buf.getvalue()


def peak_rss_kib() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def rss_kib() -> int:
    """This process's resident set size now (KiB, Linux's ``/proc/self/statm``)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() // 1024


# ---------------------------------------------------------------- regression: the thin image


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("center_crop", "too_large"), ("keep_ratio", "too_large"), ("no", "too_large"), ("border", (512, 512))],
)
def test_a_1x2000000_png_is_a_counted_rejection_not_an_exception(mode, expected):
    """Issue 14: 2,000,000 px pass ``max_image_pixels`` but cover-resizing to 512 asked OpenCV for 1.57 TB."""
    data = png(1, 2_000_000)
    fetch = FetchSettings(resize_mode=mode)  # image_size 512, max_image_pixels 89,478,485
    if expected == "too_large":
        with pytest.raises(ImageRejected) as info:
            convert(data, fetch)
        assert info.value.status == "too_large"
        assert "resized" in info.value.message or "JPEG" in info.value.message, info.value.message
    else:  # border scales the *longer* side to the target: always bounded, still a sample
        jpeg, size, original = convert(data, fetch)
        assert (size, original, decode(jpeg).shape[:2]) == (expected, (1, 2_000_000), expected)


def test_the_resize_bound_is_max_image_pixels_on_the_resized_image():
    """center_crop/keep_ratio: the image *before* cropping must fit ``max_image_pixels`` (it is what is allocated)."""
    fetch = FetchSettings(image_size=32, resize_mode="center_crop", max_image_pixels=3200)
    jpeg, size, _ = convert(png(50, 16), fetch)  # 800 px resized to 100×32 = the bound: kept
    assert size == (32, 32) and decode(jpeg).shape == (32, 32, 3)
    with pytest.raises(
        ImageRejected, match=r"51x16 would be resized to 102x32 = 3264 pixels > fetch.max_image_pixels 3200"
    ):
        convert(png(51, 16), fetch)  # 816 px: the source is well under the bound
    tall = FetchSettings(image_size=32, resize_mode="keep_ratio", max_image_pixels=10_000)
    with pytest.raises(ImageRejected, match=r"32x320 = 10240 pixels"):
        convert(png(10, 100), tall)  # 10×100 → 32×320
    assert convert(png(10, 90), tall)[1] == (32, 288)


def test_keep_ratio_and_no_stay_within_jpeg_limits():
    """An output side over JPEG's limit is refused before resizing (OpenCV only said "JPEG encoding failed")."""
    with pytest.raises(ImageRejected, match=f"JPEG's {JPEG_MAX_SIDE}") as info:
        convert(png(1, 200), FetchSettings(resize_mode="keep_ratio"))  # 512×102,400: 52 M px, under the pixel bound
    assert info.value.status == "too_large"
    with pytest.raises(ImageRejected, match=f"JPEG's {JPEG_MAX_SIDE}"):
        convert(png(70_000, 1), FetchSettings(resize_mode="no"))


SUBPROCESS = """
import json, resource, sys
from pathlib import Path
from sdforge.config import FetchSettings
from sdforge.ingest.image_convert import convert
from sdforge.ingest.sources.images import ImageRejected
data, fetch = Path(sys.argv[1]).read_bytes(), FetchSettings.model_validate_json(sys.argv[2])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    result = list(convert(data, fetch)[1])
except ImageRejected as err:
    result = err.status
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"result": result, "grew_mib": (after - before) / 1024}))
"""


def convert_in_fresh_process(tmp_path: Path, data: bytes, fetch: FetchSettings) -> dict:
    """Convert ``data`` in a new interpreter; its result and how much its peak RSS grew (MiB).

    ``ru_maxrss`` only grows, so in this process an earlier test's peak would hide the conversion's."""
    (tmp_path / "image").write_bytes(data)
    proc = subprocess.run(
        [sys.executable, "-c", SUBPROCESS, str(tmp_path / "image"), fetch.model_dump_json()],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["center_crop", "keep_ratio"])
def test_a_thin_image_at_image_size_32_stays_under_a_memory_bound(tmp_path, mode):
    """Issue 14: a 274-byte 1×200,000 PNG cost 1.9 GB of RSS at ``image_size`` 32 (6,400,000×32 resized)."""
    data = png(1, 200_000)
    got = convert_in_fresh_process(tmp_path, data, FetchSettings(image_size=32, resize_mode=mode))
    assert len(data) < 1000 and got["result"] == "too_large", got
    assert got["grew_mib"] < 64, got


def test_a_png_header_is_checked_before_any_pixel_is_decoded(tmp_path):
    """Found by the property test: Pillow's ``getexif()`` (orientation, read before the size check) decodes a
    whole PNG; a 2 GB palette PNG of 80817×80817 zero rows grew RSS by GBs before it was refused."""
    rows = zlib.compressobj(9)
    idat = b"".join(rows.compress(bytes(1 + 80_817)) for _ in range(10_000)) + rows.flush()  # rows 10,000+ missing
    data = png_header(80_817, 80_817, 8, 0, idat)
    got = convert_in_fresh_process(tmp_path, data, FetchSettings(max_image_pixels=89_478_485))
    assert got["result"] == "too_large" and got["grew_mib"] < 64, got


# ---------------------------------------------------------------- any library error is a rejection


@pytest.mark.parametrize(
    "error",
    [cv2.error("OpenCV(5.0.0) Insufficient memory"), MemoryError(), ValueError("bad"), struct.error("x"), KeyError(3)],
    ids=["cv2.error", "MemoryError", "ValueError", "struct.error", "KeyError"],
)
@pytest.mark.parametrize("where", ["decode_rgb", "resize", "imencode"])
def test_every_library_error_becomes_a_rejection_with_its_reason(monkeypatch, where, error):
    def boom(*args, **kwargs):
        raise error

    if where == "imencode":
        monkeypatch.setattr(image_convert.cv2, "imencode", boom)
    else:
        monkeypatch.setattr(image_convert, where, boom)
    with pytest.raises(ImageRejected) as info:
        convert(image_bytes(40, 40, RED), FetchSettings(image_size=32))
    assert info.value.status == "failed_to_resize"
    step = {"decode_rgb": "decoding failed", "resize": "resizing failed", "imencode": "JPEG encoding failed"}[where]
    assert info.value.message.startswith(f"{step} ({type(error).__name__}"), info.value.message


def test_encoder_refusal_is_a_rejection(monkeypatch):
    monkeypatch.setattr(image_convert.cv2, "imencode", lambda *a, **kw: (False, None))
    with pytest.raises(ImageRejected, match="JPEG encoding failed") as info:
        convert(image_bytes(40, 40, RED), FetchSettings(image_size=32))
    assert info.value.status == "failed_to_resize"


def old_convert(data: bytes, fetch: FetchSettings) -> tuple[bytes, tuple[int, int], tuple[int, int]]:
    """The conversion as it was before the bound (decode, resize, encode, no checks): the byte-identity reference."""
    draft = fetch.image_size if fetch.resize_mode != "no" else None
    rgb, original = decode_rgb(data, fetch.max_image_pixels, draft_size=draft)
    img = np.ascontiguousarray(rgb[:, :, ::-1])
    size, mode = fetch.image_size, fetch.resize_mode
    if mode != "no":
        h, w = img.shape[:2]
        scale = size / (max(h, w) if mode == "border" else min(h, w))
        new_w, new_h = max(1, round(w * scale)), max(1, round(h * scale))
        if (new_w, new_h) != (w, h):
            interpolation = cv2.INTER_AREA if scale < 1 else cv2.INTER_LANCZOS4
            img = cv2.resize(img, (new_w, new_h), interpolation=interpolation)
        if mode == "center_crop":
            top, left = (new_h - size) // 2, (new_w - size) // 2
            img = img[top : top + size, left : left + size]
        elif mode == "border":
            dh, dw = size - new_h, size - new_w
            img = cv2.copyMakeBorder(img, dh // 2, dh - dh // 2, dw // 2, dw - dw // 2, cv2.BORDER_CONSTANT, value=0)
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, fetch.encode_quality])
    assert ok
    return buf.tobytes(), (img.shape[1], img.shape[0]), original


@pytest.mark.parametrize("mode", ["center_crop", "keep_ratio", "border", "no"])
@pytest.mark.parametrize("size", [32, 512])
def test_ordinary_images_convert_byte_identically_to_before(mode, size):
    rng = np.random.default_rng(size)
    noisy = cv2.imencode(".png", rng.integers(0, 255, (300, 200, 3), dtype=np.uint8))[1].tobytes()
    for data in (noisy, image_bytes(640, 480, BLUE), png(33, 1000), png(1, 7, "RGBA")):
        fetch = FetchSettings(image_size=size, resize_mode=mode)
        assert convert(data, fetch) == old_convert(data, fetch)


# ---------------------------------------------------------------- through reshard


def test_a_hostile_image_next_to_a_good_one_leaves_the_good_one_written(tmp_path):
    """Issue 14: the hostile image's ``cv2.error`` escaped ``reshard`` and the good image of its shard was lost."""
    meta, out = tmp_path / "meta", tmp_path / "out"
    (meta / "imgs").mkdir(parents=True)
    (meta / "imgs" / "good.png").write_bytes(image_bytes(40, 40, BLUE, "PNG"))
    (meta / "imgs" / "thin.png").write_bytes(png(1, 2_000_000))
    filtered = tmp_path / "filtered.parquet"
    write_rows([row(None, f"imgs/{n}.png", n, {}) for n in ("good", "thin")], filtered)
    reshard.run(filtered, meta, out, FetchSettings(image_size=512, shard_size=10, processes=1), "test")
    assert status_totals(out) == {"success": 1, "too_large": 1}
    assert statuses(out) == {"imgs/good.png": "success", "imgs/thin.png": "too_large"}
    jpg = decode(samples_by_member(out)["imgs/good.png"]["jpg"])
    assert jpg.shape == (512, 512, 3) and close_to(tuple(int(v) for v in jpg[256, 256]), BLUE)


# ---------------------------------------------------------------- property test of the image path

FORMAT_MODES = {  # format: (modes Pillow writes to it, longest side it allows)
    "PNG": (("1", "L", "LA", "P", "RGB", "RGBA", "I;16", "RGB16"), 1 << 20),
    "TIFF": (("1", "L", "LA", "P", "RGB", "RGBA", "CMYK", "I;16", "I", "F"), 1 << 20),
    "JPEG": (("L", "RGB", "CMYK"), 65_500),
    "WEBP": (("RGB", "RGBA"), 16_383),
    "GIF": (("L", "P"), 65_535),
    "BMP": (("1", "L", "P", "RGB"), 1 << 20),
}
PROPERTY_MAX_PIXELS = (64, 10_000, 250_000, 1_000_000)
"""``fetch.max_image_pixels`` drawn per example: small, so that the generated images cross every bound."""
MEMORY_CEILING_MIB = 128
"""Peak RSS one conversion may add over the RSS before it (a 1×300,000 image cover-resized to 64 was 3.7 GB)."""

SIDES = st.one_of(
    st.tuples(st.integers(1, 64), st.integers(1, 64)),  # tiny, 1 px included
    st.tuples(st.integers(1, 3), st.integers(1, 300_000)),  # very thin (tall)
    st.tuples(st.integers(1, 300_000), st.integers(1, 3)),  # very wide
    st.tuples(st.integers(1, 1500), st.integers(1, 1500)),
)


def pixels(mode: str, w: int, h: int, seed: int) -> Image.Image | bytes:
    """Random pixels of ``mode`` (``RGB16``: 16-bit RGB, written by OpenCV since Pillow cannot)."""
    rng = np.random.default_rng(seed)
    if mode == "RGB16":
        return cv2.imencode(".png", rng.integers(0, 65536, (h, w, 3), dtype=np.uint16))[1].tobytes()
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (h, w), dtype=np.uint16))
    if mode == "I":
        return Image.fromarray(rng.integers(-(2**31), 2**31 - 1, (h, w), dtype=np.int32))
    if mode == "F":
        return Image.fromarray(rng.normal(128, 200, (h, w)).astype(np.float32))
    return Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA").convert(mode)


@st.composite
def encoded_images(draw) -> bytes:
    """A real image file: random format, mode (bit depth), size; maybe truncated or with a byte flipped."""
    fmt = draw(st.sampled_from(sorted(FORMAT_MODES)))
    modes, longest = FORMAT_MODES[fmt]
    mode = draw(st.sampled_from(modes))
    w, h = draw(SIDES)
    img = pixels(mode, min(w, longest), min(h, longest), draw(st.integers(0, 2**32 - 1)))
    if isinstance(img, bytes):
        data = img
    else:
        buf = io.BytesIO()
        img.save(buf, fmt)
        data = buf.getvalue()
    damage = draw(st.sampled_from(["none", "none", "none", "truncated", "flipped"]))
    if damage == "truncated":
        data = data[: int(len(data) * draw(st.floats(0, 1)))]
    elif damage == "flipped" and data:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1 :]
    return data


@st.composite
def lying_pngs(draw) -> bytes:
    """A PNG whose header says anything up to 2³¹-1 a side: no pixel data, junk, or valid all-zero rows."""
    w, h = draw(st.one_of(SIDES, st.tuples(st.integers(1, 2**31 - 1), st.integers(1, 2**31 - 1))))
    depth, colour, channels = draw(
        st.sampled_from([(1, 0, 1), (8, 0, 1), (16, 0, 1), (8, 2, 3), (16, 6, 4), (8, 3, 1)])
    )
    data = draw(st.sampled_from(["none", "junk", "zeros"]))
    raw = h * (1 + (w * depth * channels + 7) // 8)
    if data == "zeros" and raw <= 4_000_000:  # the issue's "2 KB PNG of 1×2,000,000 px" kind
        return png_header(w, h, depth, colour, zlib.compress(bytes(raw), 9))
    return png_header(w, h, depth, colour, None if data == "none" else draw(st.binary(max_size=64)))


FETCHES = st.tuples(
    st.sampled_from([8, 32, 64, 512]),
    st.sampled_from(["center_crop", "keep_ratio", "border", "no"]),
    st.sampled_from(PROPERTY_MAX_PIXELS),
    st.sampled_from([50, 95]),
).map(
    lambda s: FetchSettings(
        image_size=s[0],
        resize_mode=s[1],
        max_image_pixels=max(s[2], s[0] ** 2),  # the config refuses a limit below the output size
        encode_quality=s[3],
    )
)
MINIMA = st.sampled_from([None, None, None, 1, 16, 64])
ISSUE_EXAMPLES = [  # the issue's two images, always run first
    (png(1, 2_000_000), FetchSettings()),  # 1.57 TB asked of OpenCV at 512
    (png(1, 200_000), FetchSettings(image_size=32, max_image_pixels=1_000_000)),  # 1.9 GB of RSS at 32
]


def check_one(data: bytes, fetch: FetchSettings, min_width: int | None, min_height: int | None) -> bool:
    """Convert; assert a bounded, decodable image or a rejection with a known status. True: a sample came out."""
    try:
        jpeg, (w, h), (ow, oh) = convert(data, fetch, min_width, min_height)
    except ImageRejected as err:
        assert err.status in STATUSES and err.message, (err.status, err.message)
        return False
    out = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR)
    assert out is not None and out.shape == (h, w, 3)
    assert ow * oh <= fetch.max_image_pixels and ow >= (min_width or 0) and oh >= (min_height or 0)
    size = fetch.image_size
    if fetch.resize_mode in ("center_crop", "border"):
        assert (w, h) == (size, size)
    elif fetch.resize_mode == "keep_ratio":
        assert min(w, h) == size and w * h <= fetch.max_image_pixels and max(w, h) <= JPEG_MAX_SIDE
    else:
        assert (w, h) == (ow, oh) and max(w, h) <= JPEG_MAX_SIDE
    return True


def example_all(cases: list[tuple[bytes, FetchSettings]]):
    """``hypothesis.example`` for each ``(data, fetch)`` of ``cases`` (no minimum size)."""

    def decorate(test):
        for data, fetch in reversed(cases):
            test = example(data=data, fetch=fetch, min_width=None, min_height=None)(test)
        return test

    return decorate


def run_property(max_examples: int, derandomize: bool) -> dict[str, float]:
    """Run the property ``max_examples`` times; return counts, the largest RSS growth of one conversion and the
    process's peak RSS (MiB).

    Per example: the peak RSS after converting must stay within :data:`MEMORY_CEILING_MIB` of the RSS before (or
    of the earlier peak, which ``ru_maxrss`` cannot go below). ``derandomize``: the same examples every run
    (the default suite); the slow run explores new ones each time."""
    counts = {"examples": 0, "samples": 0, "rejections": 0, "max_grew_mib": 0.0}

    @settings(
        max_examples=max_examples,
        derandomize=derandomize,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(data=st.one_of(encoded_images(), lying_pngs()), fetch=FETCHES, min_width=MINIMA, min_height=MINIMA)
    @example_all(ISSUE_EXAMPLES)
    def prop(data, fetch, min_width, min_height):
        before, peak_before = rss_kib(), peak_rss_kib()
        counts["samples" if check_one(data, fetch, min_width, min_height) else "rejections"] += 1
        counts["examples"] += 1
        grew = (peak_rss_kib() - before) / 1024
        if peak_rss_kib() > peak_before:
            counts["max_grew_mib"] = max(counts["max_grew_mib"], grew)
        assert peak_rss_kib() <= max(peak_before, before + MEMORY_CEILING_MIB * 1024), f"RSS grew {grew:.0f} MiB"

    prop()
    result = counts | {"peak_rss_mib": peak_rss_kib() / 1024}
    print(f"\nimage-path property: {json.dumps(result)}")
    return result


def test_image_path_property():
    """Bounded examples for the default suite (a few seconds)."""
    result = run_property(max_examples=60, derandomize=True)
    assert result["examples"] >= 30 and result["samples"] > 0 and result["rejections"] > 0


@pytest.mark.slow
def test_image_path_property_long():
    """``-m slow``: many more examples of the same property."""
    result = run_property(max_examples=3000, derandomize=False)
    assert result["examples"] >= 1000 and result["samples"] > 0 and result["rejections"] > 0
