"""Canny edge maps, bit-packed for storage, and the edge F1 that scores controllability (ControlNet++, Li et al.
2024: re-extract the edges of a generated image with the condition's thresholds, binary F1 over pixels).

Pure numpy + OpenCV; no I/O. An edge map is a ``bool`` array ``[H, W]``.
"""

from __future__ import annotations

import cv2
import numpy as np


def canny_edges(rgb: np.ndarray, low_threshold: int, high_threshold: int) -> np.ndarray:
    """The Canny edges of an RGB ``uint8`` image ``[H, W, 3]`` as ``bool [H, W]`` — OpenCV's Canny on the colour image
    (the gradient of the strongest channel), as ControlNet's own annotator calls it."""
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"canny_edges needs an RGB uint8 image [H, W, 3]; got {rgb.dtype} {rgb.shape}")
    return cv2.Canny(np.ascontiguousarray(rgb), low_threshold, high_threshold) > 0


def pack_edges(edges: np.ndarray) -> np.ndarray:
    """``bool [H, W]`` → ``uint8 [ceil(H·W / 8)]``, row-major, 8 pixels a byte (1 bit each: 1/8 of a uint8 map)."""
    return np.packbits(edges.reshape(-1))


def unpack_edges(packed: np.ndarray, height: int, width: int) -> np.ndarray:
    """:func:`pack_edges` undone: ``bool [H, W]``."""
    return np.unpackbits(np.asarray(packed, dtype=np.uint8), count=height * width).astype(bool).reshape(height, width)


def edge_f1(condition: np.ndarray, generated: np.ndarray) -> float:
    """Binary F1 between a condition's edge map and the edges re-extracted from an image generated under it (both
    ``bool [H, W]``); 1.0 when both are empty, 0.0 when exactly one is."""
    if condition.shape != generated.shape:
        raise ValueError(f"edge maps differ in shape: {condition.shape} vs {generated.shape}")
    hits = int(np.logical_and(condition, generated).sum())
    total = int(condition.sum()) + int(generated.sum())
    return 1.0 if total == 0 else 2.0 * hits / total


def filled_outline(edges: np.ndarray) -> np.ndarray:
    """The region an edge map's outer contours enclose, filled (``bool [H, W]``): where a condition asks for a
    shape (the placement score's truth)."""
    contours, _ = cv2.findContours(edges.astype(np.uint8), cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_NONE)
    filled = np.zeros(edges.shape, np.uint8)
    cv2.drawContours(filled, contours, -1, 1, thickness=-1)
    return filled.astype(bool)


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two ``bool`` masks; 1.0 when both are empty."""
    union = int(np.logical_or(a, b).sum())
    return 1.0 if union == 0 else int(np.logical_and(a, b).sum()) / union
