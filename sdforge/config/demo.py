"""``demo``: the synthetic captioned corpus (coloured shapes on plain backgrounds) the embedded demo trains on."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from sdforge.config.base import RGB, Section


class DemoConcept(Section):
    """A colour word that only a small extra demo source shows (``<demo_source>/concept/``): what the demo's
    adapter phase teaches a model that has never seen it."""

    colour: str
    rgb: RGB
    images: int = Field(96, ge=1)
    """Images in the concept source: its colour on every shape and background, in turn, on ``canvases``."""


class DemoWebdump(Section):
    """A demo source whose captions are useless — camera file names — so only recaptioning makes it trainable
    (``<demo_source>/webdump/``; ``make demo-recaption``)."""

    images: int = Field(192, ge=1)
    """Images of shown colour/shape/background combinations (never a held-out one nor the concept colour)."""


class DemoPlaced(Section):
    """A demo source whose shapes are small and anywhere on the canvas (``<demo_source>/placed/``): where a shape is
    drawn is then the condition's to say, which the demo's ControlNet phase learns (``make demo-controlnet``)."""

    images: int = Field(480, ge=1)
    """Images of shown colour/shape/background combinations (never a held-out one nor the concept colour)."""
    half_size: tuple[Annotated[float, Field(gt=0, le=0.45)], Annotated[float, Field(gt=0, le=0.45)]] = (0.12, 0.3)
    """Range of a shape's half-width (fraction of the canvas's shorter side): smaller than the corpus' shapes, so
    they fit anywhere."""


class DemoData(Section):
    """The synthetic captioned corpus: coloured shapes on plain backgrounds."""

    enabled: bool = True
    seed: int = 0
    image_size: int = Field(48, ge=16)
    half_size: tuple[Annotated[float, Field(gt=0, le=0.45)], Annotated[float, Field(gt=0, le=0.45)]] = (0.22, 0.32)
    """Range of a shape's half-width, as a fraction of the canvas's shorter side (``image_size`` for a square
    one); its centre jitters anywhere the shape fits on the canvas."""
    canvases: list[tuple[Annotated[int, Field(ge=16)], Annotated[int, Field(ge=16)]]] = []
    """(width, height) canvases the corpus images are drawn on, in turn: the ``i``-th image a source draws
    (LAION rows in drawing order: served, missing, the bad kinds; archive images in order) is on
    ``canvases[i % len(canvases)]``. Empty: one square ``image_size`` canvas (every image square)."""
    laion_rows: int = Field(0, ge=0)
    archive_images: int = Field(0, ge=0)
    http_port: int = Field(8765, ge=1024, le=65535)
    colours: dict[str, RGB]
    shapes: list[Literal["circle", "square", "triangle"]]
    backgrounds: dict[str, RGB]
    # rows the quality filter must drop / the fetch must survive, each a count
    low_aesthetic_rows: int = Field(0, ge=0)
    watermark_rows: int = Field(0, ge=0)
    nsfw_rows: int = Field(0, ge=0)
    small_rows: int = Field(0, ge=0)
    duplicate_rows: int = Field(0, ge=0)
    missing_rows: int = Field(0, ge=0)
    held_out: list[tuple[str, str, str]] = []
    """(colour, shape, background) combinations the corpus never shows (nor the VAE's training renders):
    eval prompts that ask for them measure whether the model composes words it saw only apart."""
    concept: DemoConcept | None = None
    """A new colour word for the adapter phase; the LAION and DiffusionDB parts never show it (nor the VAE)."""
    webdump: DemoWebdump | None = None
    """A source captioned with file names (recaptioned by the demo captioner); null: none."""
    placed: DemoPlaced | None = None
    """A source of small shapes anywhere on the canvas (the ControlNet demo's); null: none."""

    @model_validator(mode="after")
    def _concept_is_new(self) -> DemoData:
        if self.concept is not None and self.concept.colour in self.colours:
            raise ValueError(f"concept.colour {self.concept.colour!r} is already a demo colour: it would not be new")
        return self

    @model_validator(mode="after")
    def _names_disjoint(self) -> DemoData:
        if self.enabled and (not self.colours or not self.shapes or not self.backgrounds):
            raise ValueError("demo needs at least one colour, shape and background")
        return self

    @model_validator(mode="after")
    def _held_out_leaves_every_word(self) -> DemoData:
        for i, (colour, shape, background) in enumerate(self.held_out):
            for name, known in ((colour, self.colours), (shape, self.shapes), (background, self.backgrounds)):
                if name not in known:
                    raise ValueError(f"held_out[{i}]: {name!r} is not a demo colour, shape or background")
        hidden = set(self.held_out)
        every = [(c, s, b) for c in self.colours for s in self.shapes for b in self.backgrounds]
        shown = [combo for combo in every if combo not in hidden]
        for axis, names in enumerate((self.colours, self.shapes, self.backgrounds)):
            lost = sorted(set(names) - {combo[axis] for combo in shown})
            if lost:
                raise ValueError(f"held_out hides every combination with {lost}: the model could never learn the word")
        return self

    @model_validator(mode="after")
    def _shapes_fit_every_canvas(self) -> DemoData:
        for width, height in self.canvas_sizes if self.enabled else []:
            half = int(min(width, height) * self.half_size[1])
            if min(width, height) - 2 * half - 4 < 1:
                raise ValueError(
                    f"canvas {width}x{height} (demo.canvases, else demo.image_size) is too small for half_size "
                    f"{self.half_size[1]}: a {2 * half}-px shape and 2-px margins leave its centre no room"
                )
        return self

    def is_held_out(self, colour: str, shape: str, background: str) -> bool:
        """Whether the corpus never shows this combination."""
        return (colour, shape, background) in set(self.held_out)

    def is_concept(self, colour: str) -> bool:
        """Whether ``colour`` is the concept colour (only the concept source shows it)."""
        return self.concept is not None and colour == self.concept.colour

    @property
    def palette(self) -> dict[str, RGB]:
        """Every colour the demo draws and the probe reads: ``colours`` plus the concept's."""
        extra = {self.concept.colour: self.concept.rgb} if self.concept else {}
        return {**self.colours, **extra}

    @property
    def canvas_sizes(self) -> list[tuple[int, int]]:
        """``canvases``, or ``[(image_size, image_size)]`` when empty."""
        return [tuple(c) for c in self.canvases] or [(self.image_size, self.image_size)]
