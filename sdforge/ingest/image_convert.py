"""One image's bytes to a sample JPEG: checked and decoded, resized like img2dataset, JPEG-encoded.

Decoding (header size checked before any pixel, every pixel format to 8-bit RGB) is
:func:`sdforge.ingest.sources.images.decode_rgb`; the size, resize mode and quality are ``fetch``'s.

One decode policy for every fetch path: the local kinds' re-shard calls :func:`convert`, and the URL fetch hands
img2dataset a :class:`SampleResizer`, which calls it on the downloaded bytes in place of img2dataset's own OpenCV
decode. So the same file gets the same pixels, status, message and ``original_width/height`` either way: EXIF
orientation applied (the original size is the size as displayed, after it), float/HDR and other formats PIL
does not read (:data:`~sdforge.bounds.images.SAFE_FORMATS`) refused ``failed_to_resize``, 16-bit scaled to 8.

Bounds. ``fetch.max_image_pixels`` limits the *source* image (its header, before decoding) and also the
*resized* one, computed before :func:`resize` allocates it (:func:`check_resized`): the image as scaled
before cropping or padding (:func:`resized_size`), which is what ``cv2.resize`` allocates. For
``center_crop`` and ``keep_ratio`` the shorter side is scaled to ``image_size``, so a 1×N image would
become (N·size)×size (a 1×2,000,000 PNG of 4 KB asked OpenCV for 1.57 TB at 512); it is rejected
``too_large`` when that exceeds ``max_image_pixels``, i.e. when its aspect ratio exceeds
``max_image_pixels / image_size²`` (341:1 with the defaults). ``border`` scales the longer side, so its
resized image is at most ``image_size²`` and ``no`` keeps the source size: both are bounded already.
An output side over JPEG's :data:`JPEG_MAX_SIDE` (``keep_ratio``, ``no``) is ``too_large`` as well.
Memory per sample is therefore a small multiple of ``max_image_pixels`` whatever the header says.

Errors. Every per-sample failure, whatever library raises it (PIL, OpenCV's ``cv2.error``, numpy,
``MemoryError``...), leaves :func:`convert` as :class:`ImageRejected` with its status and reason, so
the caller counts it and goes on with the next image.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import cv2
import numpy as np

from sdforge.config import FetchSettings
from sdforge.ingest.buckets import CropPlan
from sdforge.ingest.sources.images import ImageRejected, decode_rgb

JPEG_MAX_SIDE = 65_500
"""The longest side OpenCV's JPEG encoder accepts."""
_MAX_REASON = 300
"""Characters of a library's error message kept in ``error_message`` (OpenCV's run to several lines)."""
T = TypeVar("T")


def resized_size(w: int, h: int, size: int, mode: str) -> tuple[int, int]:
    """``(width, height)`` a ``w``×``h`` image is scaled to by :func:`resize`, before cropping or padding."""
    if mode == "no":
        return w, h
    scale = size / (max(h, w) if mode == "border" else min(h, w))
    return max(1, round(w * scale)), max(1, round(h * scale))


def check_resized(w: int, h: int, size: int, mode: str, max_pixels: int) -> None:
    """Raise ``too_large`` when resizing a ``w``×``h`` image would allocate more than ``max_pixels`` pixels,
    or produce an image with a side over :data:`JPEG_MAX_SIDE`."""
    new_w, new_h = resized_size(w, h, size, mode)
    if new_w * new_h > max_pixels:
        raise ImageRejected(
            "too_large",
            f"{w}x{h} would be resized to {new_w}x{new_h} = {new_w * new_h} pixels > fetch.max_image_pixels "
            f"{max_pixels} (aspect ratio {max(w, h) / min(w, h):.0f}:1)",
        )
    out_w, out_h = (size, size) if mode in ("center_crop", "border") else (new_w, new_h)
    if max(out_w, out_h) > JPEG_MAX_SIDE:
        raise ImageRejected("too_large", f"{w}x{h} would become {out_w}x{out_h}: a side over JPEG's {JPEG_MAX_SIDE}")


def resize(img: np.ndarray, size: int, mode: str) -> np.ndarray:
    """img2dataset's resize modes: ``center_crop``/``keep_ratio`` scale the shorter side to ``size``
    (then crop the centre square, or not), ``border`` scales the longer side and pads with black.

    Unbounded by itself: :func:`convert` calls :func:`check_resized` first."""
    if mode == "no":
        return img
    h, w = img.shape[:2]
    new_w, new_h = resized_size(w, h, size, mode)
    if (new_w, new_h) != (w, h):
        scale = size / (max(h, w) if mode == "border" else min(h, w))
        interpolation = cv2.INTER_AREA if scale < 1 else cv2.INTER_LANCZOS4
        img = cv2.resize(img, (new_w, new_h), interpolation=interpolation)
    if mode == "center_crop":
        top, left = (new_h - size) // 2, (new_w - size) // 2
        img = img[top : top + size, left : left + size]
    elif mode == "border":
        dh, dw = size - new_h, size - new_w
        img = cv2.copyMakeBorder(
            img, dh // 2, dh - dh // 2, dw // 2, dw - dw // 2, cv2.BORDER_CONSTANT, value=(0, 0, 0)
        )
    return img


def resize_to_bucket(img: np.ndarray, plan: CropPlan) -> np.ndarray:
    """``img`` resized (aspect kept) to ``plan.resized`` and cropped to ``plan.box``: an array of the bucket's
    shape (:mod:`sdforge.ingest.buckets`). With a square bucket this is exactly :func:`resize`'s
    ``center_crop`` (same scale, interpolation and offsets)."""
    h, w = img.shape[:2]
    if (w, h) != plan.resized:
        interpolation = cv2.INTER_AREA if plan.resized[0] < w else cv2.INTER_LANCZOS4
        img = cv2.resize(img, plan.resized, interpolation=interpolation)
    left, top, right, bottom = plan.box
    return img[top:bottom, left:right]


def _rejecting(step: str, fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)``; any exception but :class:`ImageRejected` becomes a ``failed_to_resize`` one
    naming ``step`` and the library's error (``MemoryError`` included: one sample, not the run)."""
    try:
        return fn(*args, **kwargs)
    except ImageRejected:
        raise
    except Exception as err:
        reason = " ".join(str(err).split())[:_MAX_REASON]
        raise ImageRejected("failed_to_resize", f"{step} failed ({type(err).__name__}: {reason})") from None


def convert(
    data: bytes, fetch: FetchSettings, min_width: int | None = None, min_height: int | None = None
) -> tuple[bytes, tuple[int, int], tuple[int, int]]:
    """Check, decode, resize and JPEG-encode one image; return ``(jpeg, (w, h), (orig_w, orig_h))``.

    Raises :class:`ImageRejected` (``failed_to_resize``, ``too_large``, ``too_small``) and nothing else
    (short of ``KeyboardInterrupt``/``SystemExit``): see the module docstring for the bounds.
    """
    draft = fetch.image_size if fetch.resize_mode != "no" else None
    rgb, original = _rejecting(
        "decoding", decode_rgb, data, fetch.max_image_pixels, min_width, min_height, draft_size=draft
    )
    h, w = rgb.shape[:2]  # a JPEG may have been decoded at a reduced scale (draft): this is what gets resized
    check_resized(w, h, fetch.image_size, fetch.resize_mode, fetch.max_image_pixels)
    bgr = _rejecting("resizing", np.ascontiguousarray, rgb[:, :, ::-1])
    out = _rejecting("resizing", resize, bgr, fetch.image_size, fetch.resize_mode)
    ok, buf = _rejecting("JPEG encoding", cv2.imencode, ".jpg", out, [cv2.IMWRITE_JPEG_QUALITY, fetch.encode_quality])
    if not ok:
        raise ImageRejected("failed_to_resize", "JPEG encoding failed")
    return buf.tobytes(), (out.shape[1], out.shape[0]), original


class SampleResizer:
    """img2dataset's ``Resizer`` interface over :func:`convert`, so URL images are decoded like local ones.

    img2dataset's downloader calls ``resizer(img_stream, blurring_bbox_list)`` and stores the returned
    ``(jpeg, width, height, original_width, original_height, error)``; a rejection becomes the row's
    ``failed_to_resize`` with :class:`ImageRejected`'s message. Picklable (it travels to the fetch workers).
    """

    def __init__(self, fetch: FetchSettings):
        self.fetch = fetch

    def __call__(self, img_stream, blurring_bbox_list=None):
        img_stream.seek(0)
        try:
            jpeg, (w, h), (orig_w, orig_h) = convert(img_stream.read(), self.fetch)
        except ImageRejected as err:
            return None, None, None, None, None, err.message
        return jpeg, w, h, orig_w, orig_h, None
