"""``eval``: the fixed prompts by category and the sampler settings of the per-phase eval grid and its metrics."""

from __future__ import annotations

import logging
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from sdforge.config.base import GuidanceScale, PositiveInt, SafeName, Section, Seed

log = logging.getLogger(__name__)


class CategorySampling(Section):
    """Per-category overrides of the eval sampler settings (unset: ``eval.steps`` / ``eval.guidance_scale``)."""

    steps: PositiveInt | None = None
    guidance_scale: GuidanceScale | None = None


class Fid(Section):
    """FID of the eval images against local reference images, with a local Inception (TorchScript)."""

    inception_path: str | None = None
    """NVlabs ``pt_inception-2015-12-05`` TorchScript file (called as ``model(x, return_features=True)``
    on N×3×H×W floats in 0..255); null: the one ``models.fid_inception`` has ``prepare_models`` copy, else FID
    skipped."""
    reference_dir: str | None = None
    """Folder of reference images (png/jpg/webp, searched recursively); null: FID skipped."""
    max_reference_images: int = Field(10_000, ge=2)


SampleCount = Annotated[int, Field(ge=2)]
"""Images a FID is computed over (it needs a covariance: at least 2); ``eval.coco.samples`` and ``--samples``."""


class CocoProtocol(Section):
    """Zero-shot FID and CLIP score on COCO-2014 validation captions (``sdforge evaluate --protocol coco`` and,
    with ``phase_end_samples``, each phase's ``eval_grid``). docs/EVAL.md pins the protocol."""

    captions: str | None = None
    """``captions_val2014.json`` (cocodataset.org, ``annotations_trainval2014.zip``); null: the protocol is off."""
    images: str | None = None
    """The ``val2014/`` folder its ``file_name`` entries are relative to (the FID reference images)."""
    samples: SampleCount = 30_000
    """Captions ``sdforge evaluate --protocol coco`` samples by default (FID-30k)."""
    phase_end_samples: int = Field(0, ge=0)
    """Captions each phase's ``eval_grid`` also evaluates (full scale: 5,000, FID-5k); 0: not at phase end."""
    seed: Seed = 2014
    """Picks the images and one caption of each (the same in every phase); image ``i`` is sampled with seed
    ``seed + i``."""
    steps: PositiveInt | None = None
    """Sampler steps (null: ``eval.steps``)."""
    guidance_scale: GuidanceScale | None = None
    """CFG scale (null: ``eval.guidance_scale``)."""
    reference_size: int | None = Field(None, ge=16)
    """Side of the square the reference images are centre-cropped and resized (PIL bicubic) to; null: the
    generated images' side. The Inception resizes both sets to 299² itself."""

    @model_validator(mode="after")
    def _phase_end_needs_files(self) -> CocoProtocol:
        if self.phase_end_samples and not (self.captions and self.images):
            raise ValueError("phase_end_samples > 0 needs captions (captions_val2014.json) and images (val2014/)")
        return self


GUIDANCE_WARN_ABOVE = 9.0
"""CFG above this over-saturates SD1.x samples (the reference run used 7.5 for scenes, 8.5 for people)."""


class Eval(Section):
    """Fixed prompts by category and sampler settings for the per-phase eval grid and its metrics."""

    prompts: dict[SafeName, list[str]]
    """category → prompts. A plain list is one category, ``all`` (the demo's colour/shape probe prompts)."""
    negative_prompt: str = ""
    steps: PositiveInt = 100
    guidance_scale: GuidanceScale = 7.5
    sampling: dict[SafeName, CategorySampling] = {}
    """category → steps / guidance_scale for that category (others use the two values above)."""
    seed: Seed = 1234
    """Prompt ``i`` of a category is sampled with seed ``seed + i``, in every phase."""
    columns: int = Field(4, ge=1)
    batch_size: PositiveInt = 8
    clip_model_path: str | None = None
    """Local folder of a transformers ``CLIPModel`` + processor (e.g. openai/clip-vit-large-patch14
    saved with ``save_pretrained``); null: the one ``models.eval_clip`` has ``prepare_models`` save, else CLIP
    score skipped."""
    fid: Fid = Fid()
    coco: CocoProtocol = CocoProtocol()
    extra_sizes: list[tuple[Annotated[int, Field(gt=0)], Annotated[int, Field(gt=0)]]] = []
    """(width, height) of extra, usually non-square, cells: the first ``extra_prompts`` prompts of the first
    category sampled at each size (same seeds and settings as their square cells), shown as rows below the
    square cells and probed apart. Each side must be a multiple of the model's pixel multiple (checked
    against the loaded model before any sampling; SD 1.x: 64)."""
    extra_prompts: int = Field(4, ge=1)
    """How many of the first category's prompts each ``extra_sizes`` entry samples (all of them if fewer)."""
    control_samples: int = Field(8, ge=1)
    """A ControlNet phase's held-out samples drawn under their own condition and caption, with and without the
    ControlNet (ControlNet++'s protocol: ``controlnet.canny_f1``; docs/CONTROL.md). Its first ones, in the held-out
    index's order; samples without a condition are passed over."""

    @field_validator("extra_sizes")
    @classmethod
    def _extra_sizes_distinct(cls, sizes: list[tuple[int, int]]) -> list[tuple[int, int]]:
        repeated = sorted({f"{w}x{h}" for w, h in sizes if sizes.count((w, h)) > 1})
        if repeated:
            raise ValueError(f"sizes listed twice: {repeated}")
        return sizes

    @field_validator("prompts", mode="before")
    @classmethod
    def _list_is_one_category(cls, prompts: object) -> object:
        return {"all": prompts} if isinstance(prompts, list) else prompts

    @field_validator("prompts")
    @classmethod
    def _non_empty(cls, prompts: dict[str, list[str]]) -> dict[str, list[str]]:
        if not prompts:
            raise ValueError("needs at least one category of prompts")
        empty = sorted(name for name, texts in prompts.items() if not texts)
        if empty:
            raise ValueError(f"categories without prompts: {empty}")
        return prompts

    @model_validator(mode="after")
    def _sampling_names_categories(self) -> Eval:
        unknown = sorted(set(self.sampling) - set(self.prompts))
        if unknown:
            raise ValueError(f"sampling: unknown categor(ies) {unknown}; defined under 'prompts': {list(self.prompts)}")
        for name in self.prompts:
            guidance = self.settings(name)[1]
            if guidance > GUIDANCE_WARN_ABOVE:
                log.warning(
                    "eval: category %r samples with guidance_scale %.1f > %.0f (over-saturated SD1.x images; "
                    "the reference run used 7.5 for scenes, 8.5 for people)",
                    name,
                    guidance,
                    GUIDANCE_WARN_ABOVE,
                )
        return self

    @property
    def all_prompts(self) -> list[str]:
        """Every prompt, category by category, in file order."""
        return [p for texts in self.prompts.values() for p in texts]

    def settings(self, category: str) -> tuple[int, float]:
        """``(steps, guidance_scale)`` for ``category``."""
        over = self.sampling.get(category, CategorySampling())
        steps = self.steps if over.steps is None else over.steps
        return steps, self.guidance_scale if over.guidance_scale is None else over.guidance_scale
