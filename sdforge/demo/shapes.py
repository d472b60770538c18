"""The synthetic demo corpus: coloured shapes on plain backgrounds, and a probe that reads them back.

Pure numpy/OpenCV, no I/O. ``render`` draws one image; ``probe`` reads the shape's colour
and kind from an image (used to score whether generated images follow their prompts).
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from sdforge.config import DemoData

SHAPES = ("circle", "square", "triangle")
TEMPLATE_SIZE = 32
"""Side of the shape templates the probe matches a foreground mask against (its bounding box scaled to this)."""


@dataclass(frozen=True)
class ShapeSpec:
    """What one demo image shows."""

    shape: str
    colour: str
    background: str

    def caption(self) -> str:
        """The canonical caption, e.g. ``a red circle on a white background`` (``an orange …``)."""
        article = "an" if self.colour[:1] in "aeiou" else "a"
        return f"{article} {self.colour} {self.shape} on a {self.background} background"


def parse_caption(caption: str) -> ShapeSpec:
    """Inverse of :meth:`ShapeSpec.caption`; raises ``ValueError`` on another form."""
    words = caption.strip().lower().split()
    if len(words) != 7 or words[0] not in ("a", "an") or words[3:5] != ["on", "a"] or words[6] != "background":
        raise ValueError(f"not a demo caption: {caption!r}")
    return ShapeSpec(shape=words[2], colour=words[1], background=words[5])


def shown_specs(
    colours: list[str], shapes: list[str], backgrounds: list[str], held_out: list[tuple[str, str, str]]
) -> list[ShapeSpec]:
    """Every (colour, shape, background) combination except the ``held_out`` ones, in a fixed order."""
    hidden = {tuple(h) for h in held_out}
    return [
        ShapeSpec(shape=s, colour=c, background=b)
        for c in colours
        for s in shapes
        for b in backgrounds
        if (c, s, b) not in hidden
    ]


class SpecDeck:
    """Draws combinations in shuffled rounds: each of ``specs`` once per round (class-balanced).

    Any ``n`` draws hold every combination ``n // len(specs)`` or one more times, where uniform draws
    from 24 combinations and 480 images left some with half the images of others.
    """

    def __init__(self, specs: list[ShapeSpec], rng: np.random.Generator):
        if not specs:
            raise ValueError("no combination left to draw: demo.held_out holds them all")
        self.specs, self.rng, self.queue = list(specs), rng, []

    def draw(self) -> ShapeSpec:
        """The next combination."""
        if not self.queue:
            self.queue = [self.specs[i] for i in self.rng.permutation(len(self.specs))]
        return self.queue.pop()


Size = int | tuple[int, int]
"""An image size: a square side, or ``(width, height)``."""


def as_wh(size: Size) -> tuple[int, int]:
    """``(width, height)`` of a :data:`Size`."""
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def render(
    spec: ShapeSpec,
    size: Size,
    colour_rgb: tuple[int, int, int],
    background_rgb: tuple[int, int, int],
    rng: np.random.Generator,
    half_size: tuple[float, float],
) -> np.ndarray:
    """Draw ``spec`` as an RGB uint8 image of ``size`` (a side, or ``(width, height)``); position and scale jitter
    with ``rng``: the shape's half-width is drawn from ``half_size`` (fractions of the canvas's shorter side),
    its centre anywhere it fits on the canvas (2 px from every edge). A square ``size`` draws what it always did."""
    width, height = as_wh(size)
    img = np.empty((height, width, 3), np.uint8)
    img[:] = background_rgb
    half = int(min(width, height) * rng.uniform(*half_size))
    cx = int(rng.integers(half + 2, width - half - 2))
    cy = int(rng.integers(half + 2, height - half - 2))
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


def truth_canvas(demo: DemoData, pixels: Size) -> tuple[int, int]:
    """The canvas a ground-truth render of ``pixels`` is drawn on before its INTER_AREA resize: ``pixels``'
    aspect with the shorter side ``demo.image_size`` (square ``pixels``: ``image_size``², as always)."""
    width, height = as_wh(pixels)
    scale = demo.image_size / min(width, height)
    return round(width * scale), round(height * scale)


def render_spec(demo: DemoData, spec: ShapeSpec, rng: np.random.Generator, pixels: Size | None = None,
                half_size: tuple[float, float] | None = None) -> np.ndarray:  # fmt: skip
    """``spec`` as the demo corpus draws it (its palette, ``demo.half_size`` unless ``half_size`` is given) at
    ``demo.image_size``, then resized to ``pixels`` with INTER_AREA (how the fetch brings it to the training size)
    when given.

    ``pixels`` may be ``(width, height)``: the shape is then drawn on :func:`truth_canvas` (that aspect, the
    shorter side ``demo.image_size``, so the shape has the corpus' size relative to the shorter side) and
    resized to exactly ``width``×``height``."""
    colour, background = demo.palette[spec.colour], demo.backgrounds[spec.background]
    canvas = truth_canvas(demo, pixels) if pixels is not None else (demo.image_size, demo.image_size)
    img = render(spec, canvas, colour, background, rng, half_size or demo.half_size)
    if pixels is not None and as_wh(pixels) != canvas:
        img = cv2.resize(img, as_wh(pixels), interpolation=cv2.INTER_AREA)
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

    The background colour is the median of the border pixels; foreground pixels are those far from
    it. Colour = nearest palette colour to the foreground's median; shape = the template (as ``render``
    draws it, filling the foreground's bounding box) with the highest overlap (IoU) with the foreground.

    Templates rather than the fill ratio alone (area / bounding-box area, the first version of this
    probe): a 32-px triangle whose tips a decoder rounds off fills ~0.65 of its box, nearer a circle's
    0.79 than a triangle's 0.5, yet it is still wide at the base and narrow at the top.
    """
    img = image.astype(np.float32)
    mask = foreground_mask(image)
    fraction = float(mask.mean())
    if fraction < min_foreground:
        return ProbeResult(colour=None, shape=None, foreground_fraction=fraction)
    colour = _nearest(np.median(img[mask], axis=0), colours)
    return ProbeResult(colour=colour, shape=_closest_template(mask), foreground_fraction=fraction)


def foreground_mask(image: np.ndarray) -> np.ndarray:
    """The pixels of an RGB uint8 image far (> 60 in RGB distance) from its background, the median of its border."""
    img = image.astype(np.float32)
    border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
    bg = np.median(border, axis=0)
    return np.sqrt(((img - bg) ** 2).sum(-1)) > 60.0


def _templates(size: int) -> dict[str, np.ndarray]:
    """Each shape filling a ``size``×``size`` box, drawn as ``render`` draws it, float in [0, 1]."""
    out = {}
    for shape in SHAPES:
        canvas = np.zeros((size, size), np.uint8)
        hi = size - 1
        if shape == "circle":
            cv2.ellipse(canvas, (hi // 2, hi // 2), (hi // 2, hi // 2), 0, 0, 360, 255, thickness=-1)
        elif shape == "square":
            canvas[:] = 255
        else:
            pts = np.array([[hi // 2, 0], [0, hi], [hi, hi]], np.int32)
            cv2.fillPoly(canvas, [pts], 255)
        out[shape] = canvas.astype(np.float32) / 255.0
    return out


_TEMPLATES = _templates(TEMPLATE_SIZE)


def _closest_template(mask: np.ndarray) -> str:
    """The shape whose template overlaps the mask's bounding-box crop best (soft IoU)."""
    ys, xs = np.nonzero(mask)
    crop = mask[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1].astype(np.float32)
    crop = cv2.resize(crop, (TEMPLATE_SIZE, TEMPLATE_SIZE), interpolation=cv2.INTER_AREA)
    iou = {s: float(np.minimum(crop, t).sum() / np.maximum(crop, t).sum()) for s, t in _TEMPLATES.items()}
    return max(iou, key=iou.get)
