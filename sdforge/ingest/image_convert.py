"""One image's bytes to a sample JPEG: checked and decoded, resized like img2dataset, JPEG-encoded.

Decoding (header size checked before any pixel, every pixel format to 8-bit RGB) is
:func:`sdforge.ingest.sources.images.decode_rgb`; the size, resize mode and quality are ``fetch``'s.
"""

from __future__ import annotations

import cv2
import numpy as np

from sdforge.config import FetchSettings
from sdforge.ingest.sources.images import ImageRejected, decode_rgb


def resize(img: np.ndarray, size: int, mode: str) -> np.ndarray:
    """img2dataset's resize modes: ``center_crop``/``keep_ratio`` scale the shorter side to ``size``
    (then crop the centre square, or not), ``border`` scales the longer side and pads with black."""
    if mode == "no":
        return img
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
        img = cv2.copyMakeBorder(
            img, dh // 2, dh - dh // 2, dw // 2, dw - dw // 2, cv2.BORDER_CONSTANT, value=(0, 0, 0)
        )
    return img


def convert(
    data: bytes, fetch: FetchSettings, min_width: int | None = None, min_height: int | None = None
) -> tuple[bytes, tuple[int, int], tuple[int, int]]:
    """Check, decode, resize and JPEG-encode one image; return ``(jpeg, (w, h), (orig_w, orig_h))``.

    Raises :class:`ImageRejected` (``failed_to_resize``, ``too_large``, ``too_small``).
    """
    draft = fetch.image_size if fetch.resize_mode != "no" else None
    rgb, original = decode_rgb(data, fetch.max_image_pixels, min_width, min_height, draft_size=draft)
    out = resize(np.ascontiguousarray(rgb[:, :, ::-1]), fetch.image_size, fetch.resize_mode)
    ok, buf = cv2.imencode(".jpg", out, [cv2.IMWRITE_JPEG_QUALITY, fetch.encode_quality])
    if not ok:
        raise ImageRejected("failed_to_resize", "JPEG encoding failed")
    return buf.tobytes(), (out.shape[1], out.shape[0]), original
