"""Reading untrusted image bytes: header checks before decoding, and every pixel format to 8-bit RGB.

Only raster formats PIL decodes itself are opened (:data:`SAFE_FORMATS`; never EPS, which would
run Ghostscript). The size in the header is checked against the pixel limit *before* any pixel is
decoded (decompression bombs), and against the minimum size. Then: EXIF orientation applied,
16-bit scaled to 8-bit (high byte), CMYK/palette/grayscale converted, alpha composited onto white.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps

from sdforge.bounds.images import (  # noqa: F401  re-exported: the image readers' bounds live in sdforge.bounds
    SAFE_FORMATS,
    ImageRejected,
    check_header,
    check_size,
)
from sdforge.bounds.images import open_header as _open
from sdforge.bounds.images import own_pixel_limit as _own_pixel_limit

_SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I")
_TRANSPOSED = (5, 6, 7, 8)
"""EXIF orientations that swap width and height."""


def upright_size(img: Image.Image) -> tuple[int, int]:
    """``(width, height)`` as displayed: swapped when the EXIF orientation rotates by 90°.

    Not header-only for PNG: Pillow decodes every pixel looking for an ``eXIf`` chunk after them, so
    check the pixel count (``img.size``) first."""
    w, h = img.size
    try:
        orientation = img.getexif().get(ExifTags.Base.Orientation, 1)
    except Exception:  # a broken EXIF block is not a reason to drop the image
        orientation = 1
    return (h, w) if orientation in _TRANSPOSED else (w, h)


def header_size(path: Path, max_pixels: int | None = None) -> tuple[int, int]:
    """Upright ``(width, height)`` of an image file from its header (no pixel decoding but a PNG's, see
    :func:`upright_size`: give ``max_pixels`` to refuse, ``too_large``, a bigger one before that)."""
    if path.stat().st_size == 0:
        raise ImageRejected("failed_to_resize", "zero-byte file")
    with _own_pixel_limit(), _open(path) as img:
        if max_pixels is not None:
            check_size(img.size, max_pixels, None, None)
        return upright_size(img)


def to_rgb(img: Image.Image) -> np.ndarray:
    """Any decoded PIL image as an ``(H, W, 3)`` uint8 RGB array; alpha composited onto white."""
    if img.mode in _SIXTEEN_BIT_MODES:
        gray = (np.clip(np.asarray(img, dtype=np.int64), 0, 65535) >> 8).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    if img.mode == "F":
        gray = np.clip(np.asarray(img, dtype=np.float64) + 0.5, 0, 255).astype(np.uint8)
        return np.repeat(gray[:, :, None], 3, axis=2)
    has_alpha = img.mode in ("RGBA", "RGBa", "LA", "La", "PA") or "transparency" in img.info
    if not has_alpha:
        return np.asarray(img.convert("RGB"))
    rgba = np.asarray(img.convert("RGBA")).astype(np.float32)
    alpha = rgba[:, :, 3:4] / 255.0
    return np.clip(rgba[:, :, :3] * alpha + 255.0 * (1.0 - alpha) + 0.5, 0, 255).astype(np.uint8)


def _exif_upright(img: Image.Image) -> Image.Image:
    try:
        return ImageOps.exif_transpose(img)
    except Exception:  # a broken EXIF block is not a reason to drop the image
        return img


def decode_rgb(
    data: bytes,
    max_pixels: int,
    min_width: int | None = None,
    min_height: int | None = None,
    draft_size: int | None = None,
) -> tuple[np.ndarray, tuple[int, int]]:
    """Decode ``data`` to upright RGB; return ``(rgb, (original_width, original_height))``.

    The header is checked before decoding (:func:`check_size`). ``draft_size``: JPEGs may be
    decoded at a reduced DCT scale as long as both sides stay ≥ it (much faster for big images).
    Raises :class:`ImageRejected`.
    """
    if not data:
        raise ImageRejected("failed_to_resize", "zero-byte file")
    with _own_pixel_limit(), _open(io.BytesIO(data)) as img:
        # the pixel count first (the same either way up): a PNG's getexif() in upright_size decodes every pixel
        check_size(img.size, max_pixels, None, None)
        size = upright_size(img)
        check_size(size, max_pixels, min_width, min_height)
        try:
            if draft_size and img.format in ("JPEG", "MPO"):
                img.draft(None, (draft_size, draft_size))
            img.load()
            rgb = to_rgb(_exif_upright(img))
        except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as err:
            raise ImageRejected("failed_to_resize", f"image decoding failed ({type(err).__name__}: {err})") from None
    if rgb.size == 0:
        raise ImageRejected("failed_to_resize", "image has no pixels")
    return rgb, size
