"""``conditions``: the conditioning images ``condition_images`` makes for a ControlNet phase, per source and bucket
crop (docs/CONTROL.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from sdforge.config.base import Section

CONDITION_KINDS = ("canny",)
"""The kinds of conditioning image the stage can make (depth, pose or segmentation would be added here)."""


class CannySettings(Section):
    """OpenCV Canny's hysteresis thresholds on the 0–255 gradient scale (ControlNet's annotator: 100 and 200)."""

    low_threshold: int = Field(100, ge=0, le=1000)
    high_threshold: int = Field(200, ge=0, le=1000)

    @model_validator(mode="after")
    def _low_below_high(self) -> CannySettings:
        if self.low_threshold > self.high_threshold:
            raise ValueError(f"low_threshold {self.low_threshold} is above high_threshold {self.high_threshold}")
        return self


class Conditions(Section):
    """Which conditioning images every source gets, and their settings."""

    kinds: list[Literal["canny"]] = []
    """The kinds made for every training sample, cropped exactly like its latent; empty (the default): none, and
    ``condition_images`` writes only its settings file."""
    canny: CannySettings = CannySettings()
