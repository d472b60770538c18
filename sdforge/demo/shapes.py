"""The synthetic demo corpus: coloured shapes on plain backgrounds, and a probe that reads them back.

Pure numpy/OpenCV, no I/O. ``render`` draws one image; ``probe`` reads the shape's colour
and kind from an image (used to score whether generated images follow their prompts).
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

SHAPES = ("circle", "square", "triangle")
# Fill ratio of each shape inside its own bounding box, as drawn by `render`.
_FILL_RATIO = {"circle": np.pi / 4, "square": 1.0, "triangle": 0.5}


@dataclass(frozen=True)
class ShapeSpec:
    """What one demo image shows."""

    shape: str
    colour: str
    background: str

    def caption(self) -> str:
        """The canonical caption, e.g. ``a red circle on a white background``."""
        return f"a {self.colour} {self.shape} on a {self.background} background"


def parse_caption(caption: str) -> ShapeSpec:
    """Inverse of :meth:`ShapeSpec.caption`; raises ``ValueError`` on another form."""
    words = caption.strip().lower().split()
    if len(words) != 7 or words[0] != "a" or words[3:5] != ["on", "a"] or words[6] != "background":
        raise ValueError(f"not a demo caption: {caption!r}")
    return ShapeSpec(shape=words[2], colour=words[1], background=words[5])


def random_spec(rng: np.random.Generator, colours: list[str], shapes: list[str], backgrounds: list[str]) -> ShapeSpec:
    """Draw a (shape, colour, background) uniformly."""
    return ShapeSpec(
        shape=str(rng.choice(shapes)), colour=str(rng.choice(colours)), background=str(rng.choice(backgrounds))
    )


def render(
    spec: ShapeSpec,
    size: int,
    colour_rgb: tuple[int, int, int],
    background_rgb: tuple[int, int, int],
    rng: np.random.Generator,
) -> np.ndarray:
    """Draw ``spec`` as an RGB uint8 image of ``size``×``size``; position and scale jitter with ``rng``."""
    img = np.empty((size, size, 3), np.uint8)
    img[:] = background_rgb
    half = int(size * rng.uniform(0.22, 0.32))
    cx = int(rng.integers(half + 2, size - half - 2))
    cy = int(rng.integers(half + 2, size - half - 2))
    colour = tuple(int(c) for c in colour_rgb)
    if spec.shape == "circle":
        cv2.circle(img, (cx, cy), half, colour, thickness=-1, lineType=cv2.LINE_AA)
    elif spec.shape == "square":
        cv2.rectangle(img, (cx - half, cy - half), (cx + half, cy + half), colour, thickness=-1)
    elif spec.shape == "triangle":
        pts = np.array([[cx, cy - half], [cx - half, cy + half], [cx + half, cy + half]], np.int32)
        cv2.fillPoly(img, [pts], colour, lineType=cv2.LINE_AA)
    else:
        raise ValueError(f"shape must be one of {SHAPES}; got {spec.shape!r}")
    return img


@dataclass(frozen=True)
class ProbeResult:
    """What :func:`probe` read from an image."""

    colour: str | None
    shape: str | None
    foreground_fraction: float


def _nearest(rgb: np.ndarray, palette: dict[str, tuple[int, int, int]]) -> str:
    names = list(palette)
    dist = [float(np.sum((rgb - np.asarray(palette[n], np.float32)) ** 2)) for n in names]
    return names[int(np.argmin(dist))]


def probe(
    image: np.ndarray,
    colours: dict[str, tuple[int, int, int]],
    backgrounds: dict[str, tuple[int, int, int]],
    min_foreground: float = 0.02,
) -> ProbeResult:
    """Read the shape's colour and kind from an RGB uint8 image.

    The background colour is the median of the border pixels; foreground pixels are those
    far from it. Colour = nearest palette colour to the foreground's median; shape = the
    palette shape whose fill ratio (area / bounding-box area) is closest.
    """
    img = image.astype(np.float32)
    border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
    bg = np.median(border, axis=0)
    mask = np.sqrt(((img - bg) ** 2).sum(-1)) > 60.0
    fraction = float(mask.mean())
    if fraction < min_foreground:
        return ProbeResult(colour=None, shape=None, foreground_fraction=fraction)
    colour = _nearest(np.median(img[mask], axis=0), colours)
    ys, xs = np.nonzero(mask)
    box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
    fill = mask.sum() / box
    shape = min(_FILL_RATIO, key=lambda s: abs(_FILL_RATIO[s] - fill))
    return ProbeResult(colour=colour, shape=shape, foreground_fraction=fraction)
