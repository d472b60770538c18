"""The ``sdforge`` command's flags, validated with the types ``params.yaml`` uses (:mod:`sdforge.config.base`):
``--steps`` and ``eval.steps`` follow one rule, as do ``--guidance`` and ``eval.guidance_scale``, ``--seed`` and
``eval.seed``. Numbers are finite and never a boolean (the :class:`Section` base); an ``--out`` that is a file, or
lies under one, is refused. A flag that does not validate is a :class:`ConfigError` of one line naming it
(``--steps: input should be greater than or equal to 1; got -5``), raised before any model is loaded; ``sdforge``
prints it and exits 2.

The image size's upper bound needs the model (its trained side, :func:`sdforge.eval.sampling.trained_side`):
:func:`check_image_size` once it is loaded.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, ValidationError, model_validator

from sdforge.config.base import MAX_SEED, ConfigError, GuidanceScale, PhaseName, PositiveInt, Section, Seed
from sdforge.config.eval import SampleCount


def check_output_folder(path: Path) -> Path:
    """``path`` unless it, or the nearest existing folder above it, is not a folder (a file): ``sdforge`` writes
    its files into ``--out`` (created if missing) and must never write over a file of that name."""
    for existing in (path, *path.parents):
        if existing.exists() or existing.is_symlink():
            if not existing.is_dir():
                raise ValueError(f"{existing} is a file, not a folder: name a folder (it is created if missing)")
            break
    return path


OutputFolder = Annotated[Path, AfterValidator(check_output_folder)]

MAX_SIZE_FACTOR = 2
"""``sdforge generate`` samples an image side of at most the model's trained side × this (SD 1.x: 512 px → 1024).
Beyond it a UNet repeats and tiles its content, and memory and time grow with the area: on f92c454 ``--width 65536``
asked for 17 GB and ``--width 4096`` on the demo model still ran after 600 s."""


def check_image_size(width: int | None, height: int | None, trained: int) -> None:
    """A :class:`ConfigError` naming the flag, the size asked and the bound when ``--width`` or ``--height`` is
    above ``trained`` (the model's trained side in px) × :data:`MAX_SIZE_FACTOR`."""
    bound = trained * MAX_SIZE_FACTOR
    for flag, side in (("--width", width), ("--height", height)):
        if side is not None and side > bound:
            raise ConfigError(
                f"{flag} {side}: at most {bound} px for this model (its trained {trained} px × MAX_SIZE_FACTOR "
                f"{MAX_SIZE_FACTOR})"
            )


class GenerateArguments(Section):
    """``sdforge generate``'s flags (those with a rule; ``--category`` is checked against ``eval.prompts``)."""

    prompt: list[str]
    steps: PositiveInt | None = None
    guidance: GuidanceScale | None = None
    seed: Seed = 0
    num_images: PositiveInt = 1
    batch_size: PositiveInt = 8
    width: PositiveInt | None = None
    height: PositiveInt | None = None
    out: OutputFolder = Path("generated")
    control_image: list[Path] = []
    """A ControlNet phase's conditioning images: one for every image, or one per ``--prompt``."""

    @model_validator(mode="after")
    def _control_images_fit(self) -> GenerateArguments:
        if len(self.control_image) not in (0, 1, len(self.prompt)):
            raise ValueError(f"--control-image: give one (for every image) or one per --prompt ({len(self.prompt)}); "
                             f"got {len(self.control_image)}")  # fmt: skip
        missing = [str(p) for p in self.control_image if not p.is_file()]
        if missing:
            raise ValueError(f"--control-image: no such file: {', '.join(missing)}")
        return self

    @property
    def control_per_image(self) -> list[Path]:
        """Each image's conditioning image file (none: ``[]``)."""
        if not self.control_image:
            return []
        per_prompt = self.control_image * len(self.prompt) if len(self.control_image) == 1 else self.control_image
        return [path for path in per_prompt for _ in range(self.num_images)]

    @model_validator(mode="after")
    def _last_seed_fits(self) -> GenerateArguments:
        last = self.seed + len(self.prompt) * self.num_images - 1
        if last > MAX_SEED:
            raise ValueError(
                f"--seed {self.seed}: image i is sampled with seed + i, and the last one's ({last}) is above "
                f"{MAX_SEED} (2**63 - 1, what torch's generator takes); pass a smaller --seed"
            )
        return self

    @property
    def seeds(self) -> list[int]:
        """The seed of each image: ``seed + i``, prompt by prompt, ``num_images`` each."""
        return [self.seed + i for i in range(len(self.prompt) * self.num_images)]


class EvaluateArguments(Section):
    """``sdforge evaluate``'s flags: the phase becomes a folder name, the samples follow ``eval.coco.samples``."""

    phase: PhaseName | None = None
    samples: SampleCount | None = None
    out: OutputFolder | None = None


class RunsArguments(Section):
    """``sdforge runs``'s flags: ``--phase`` is a phase name (the prefix of its run dirs)."""

    phase: PhaseName | None = None


ArgumentsT = TypeVar("ArgumentsT", bound=Section)


def check_arguments(model: type[ArgumentsT], args: argparse.Namespace) -> ArgumentsT:
    """``args``' values of ``model``'s fields, validated; a :class:`ConfigError` of one line naming each bad flag."""
    values = {name: getattr(args, name) for name in model.model_fields if getattr(args, name, None) is not None}
    try:
        return model.model_validate(values)
    except ValidationError as err:
        raise ConfigError("; ".join(_flag_error(error) for error in err.errors())) from None


def _flag_error(error: Any) -> str:
    """``--flag: what is wrong; got value`` for one pydantic error (a cross-flag error names its flags itself)."""
    message = error["msg"].removeprefix("Value error, ")
    if not error["loc"]:
        return message
    flag = "--" + str(error["loc"][0]).replace("_", "-")
    return f"{flag}: {message[:1].lower()}{message[1:]}; got {error.get('input')!r}"
