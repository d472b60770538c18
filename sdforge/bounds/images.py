"""Image bytes from data files, opened header first: the size a header declares is checked against
``fetch.max_image_pixels`` before any pixel is decoded (decompression bombs), and only raster formats PIL
decodes itself are opened (:data:`SAFE_FORMATS`; never EPS, which would run Ghostscript). The fetch stage's
readers (:mod:`sdforge.ingest.sources.images`) and every later decode of a fetched shard use these."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from PIL import Image, UnidentifiedImageError

SAFE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
"""PIL plugins tried (a multi-picture JPEG opens as MPO through the JPEG one)."""
MAX_BYTES_PER_PIXEL = 8
DEFAULT_MAX_PIXELS = 89_478_485
"""PIL's own bomb limit, ``fetch.max_image_pixels``' default: the bound where no source names one (eval's
reference images)."""
"""A file over ``max_image_pixels × 8`` bytes (16-bit RGBA, uncompressed) is refused unread."""


class ImageRejected(Exception):
    """An image that is not turned into a sample: ``status`` for the shard parquet, ``message`` why."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@contextlib.contextmanager
def own_pixel_limit() -> Iterator[None]:
    """PIL's own bomb check off (it warns, or raises at 2× its default): callers check the size themselves."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def open_header(fp: BinaryIO | Path) -> Image.Image:
    """Open (header only) or raise :class:`ImageRejected` (``failed_to_resize``)."""
    try:
        return Image.open(fp, formats=SAFE_FORMATS)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError) as err:
        raise ImageRejected("failed_to_resize", f"not a readable image ({type(err).__name__}: {err})") from None


def check_header(data: bytes, max_pixels: int) -> None:
    """:class:`ImageRejected` (``too_large``) when the header of image bytes ``data`` declares more than
    ``max_pixels`` pixels — read before any pixel is decoded. A header PIL cannot read passes: the decoder
    that follows reports the image."""
    try:
        with own_pixel_limit(), open_header(io.BytesIO(data)) as img:
            size = img.size
    except ImageRejected:
        return
    check_size(size, max_pixels, None, None)


def check_size(size: tuple[int, int], max_pixels: int, min_width: int | None, min_height: int | None) -> None:
    """Raise ``too_large`` / ``too_small`` for a header size outside the limits."""
    w, h = size
    if w * h > max_pixels:
        raise ImageRejected("too_large", f"{w}x{h} = {w * h} pixels > fetch.max_image_pixels {max_pixels}")
    if (min_width is not None and w < min_width) or (min_height is not None and h < min_height):
        raise ImageRejected("too_small", f"{w}x{h} is below the minimum {min_width}x{min_height}")




def open_bounded(fp: BinaryIO | Path, max_pixels: int = DEFAULT_MAX_PIXELS) -> Image.Image:
    """The image in ``fp`` (a path or a binary stream), decoded to RGB, its header checked against ``max_pixels``
    first; or :class:`ImageRejected` (``too_large``, ``failed_to_resize``)."""
    with own_pixel_limit(), open_header(fp) as img:
        check_size(img.size, max_pixels, None, None)
        try:
            return img.convert("RGB")
        except (OSError, ValueError, SyntaxError, EOFError) as err:
            raise ImageRejected("failed_to_resize", f"not a readable image ({type(err).__name__}: {err})") from None
