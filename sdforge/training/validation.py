"""Validation images during training: the eval sampler on the EMA weights every ``train.validation_every`` steps,
saved in the run dir and logged to MLflow.

The first ``train.validation_prompts`` eval prompts, with ``eval``'s default steps, guidance,
negative prompt and seeds (``eval.seed + i``), so the images line up with the phase's eval grid.
A ControlNet phase draws, instead, its first held-out samples (or, when it holds none out, its first
training samples) under their own conditions and captions, as its eval grid does, and its grid shows
each condition above its image.
Sampling draws its noise from its own CPU generators and swaps the EMA weights in and back out
exactly, so a run with validation trains bit-identically to one without.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
from diffusers import AutoencoderKL
from PIL import Image

from sdforge.config import Params
from sdforge.eval.control import HeldOutControl, condition_rgb, holds_samples, index_controls
from sdforge.eval.grid import captioned_grid
from sdforge.eval.sampling import Pipeline, generate
from sdforge.io import held_out_path
from sdforge.training.hooks import Hook

log = logging.getLogger(__name__)


class Validator:
    """Samples the validation prompts from a :class:`~sdforge.training.job.TrainJob`'s EMA weights (main rank)."""

    def __init__(self, params: Params, job) -> None:
        ev = params.eval
        self.every = params.train.validation_every
        self.prompts = ev.all_prompts[: params.train.validation_prompts]
        self.steps, self.guidance, self.seed, self.negative = ev.steps, ev.guidance_scale, ev.seed, ev.negative_prompt
        self.distill = job.phase.distill.model_dump() if job.phase.distill is not None else None
        if self.distill is not None:  # a distill phase samples as its eval grid will: few steps, no CFG
            self.steps, self.guidance = self.distill["sampling_steps"], 1.0
        self.controlnet = job.phase.controlnet.model_dump() if job.phase.controlnet is not None else None
        self.controls: list[HeldOutControl] = []
        if self.controlnet is not None:
            self.controls = validation_controls(params, job.phase_name, params.train.validation_prompts)
            self.prompts = [control.caption for control in self.controls]
            if not self.controls:
                log.warning("train.validation_every: none of %s's samples has a condition; it samples no validation "
                            "images (condition_images' metrics say why)", job.phase_name)  # fmt: skip
        self.vae = AutoencoderKL.from_pretrained(Path(params.paths.models) / "vae").to(job.dist.device).eval()

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` gets validation images."""
        return self.every > 0 and step % self.every == 0 and bool(self.prompts)

    def images(self, job) -> list[np.ndarray]:
        """One RGB uint8 image per validation prompt from the job's EMA weights; the live weights are put back."""
        unet, cond, ema, trainable = job.model.unet, job.conditioning, job.optim.ema, job.model.trainable
        pipe = Pipeline(
            unet,
            self.vae,
            cond.text,
            dict(cond.scheduler.config),
            checkpoint_hash="",
            objective=job.objective,
            flow_shift=job.phase.flow_shift,
            distill=self.distill,
            controlnet=self.controlnet,
        )
        job.optim.settle()  # a background checkpoint may still be copying the live weights
        ema.store(trainable)
        ema.copy_to(trainable)
        unet.eval()
        try:
            with cond.evaluating():
                if self.controls:
                    return [self._controlled(pipe, i, control) for i, control in enumerate(self.controls)]
                return generate(pipe, self.prompts, negative_prompt=self.negative, steps=self.steps,
                                guidance_scale=self.guidance, seeds=[self.seed + i for i in range(len(self.prompts))],
                                batch_size=len(self.prompts))  # fmt: skip
        finally:
            unet.train()
            ema.restore(trainable)

    def _controlled(self, pipe: Pipeline, i: int, control: HeldOutControl) -> np.ndarray:
        """Sample ``i`` drawn under its condition at the condition's size (seed ``eval.seed + i``)."""
        height, width = control.edges.shape
        return generate(pipe, [control.caption], control_images=[condition_rgb(control.edges)],
                        negative_prompt=self.negative, steps=self.steps, guidance_scale=self.guidance,
                        seeds=[self.seed + i], width=width, height=height)[0]  # fmt: skip

    def grid(self, images: list[np.ndarray]) -> Image.Image:
        """The captioned grid of one validation step: a row of images, each below its condition where it has one."""
        if not self.controls:
            return captioned_grid(images, self.prompts, columns=len(images))
        conditions = [condition_rgb(control.edges) for control in self.controls]
        return captioned_grid([*conditions, *images], ["condition"] * len(conditions) + self.prompts,
                              columns=len(images))  # fmt: skip


def validation_controls(params: Params, phase: str, count: int) -> list[HeldOutControl]:
    """A ControlNet phase's validation samples: its first ``count`` held-out samples with a condition, or its first
    training samples' when it holds none out (``train.held_out: 0``)."""
    index = Path(params.paths.mixes) / f"{phase}.parquet"
    held = held_out_path(index)
    if not holds_samples(held):
        log.info("train.validation_every: %s holds no samples out; its validation images are drawn under its first "
                 "training samples' conditions", phase)  # fmt: skip
    return index_controls(params, phase, held if holds_samples(held) else index, count)


VALIDATION_DIR = "validation"
"""In the run dir: ``validation/step-NNNNNNNN.png``, one captioned grid per validation step."""


class ValidationHook(Hook):
    """Every ``train.validation_every`` steps the main rank samples a captioned grid into the run dir and hands it
    to the reports (``report.artifacts``: MLflow logs it under ``validation/``); the other ranks wait for it in the
    next step (``busy_after``) — or, with a sharded model, sample the same grid beside it and drop theirs."""

    def __init__(self, params: Params, run_dir: Path):
        self.params, self.run_dir = params, Path(run_dir)
        self.every = params.train.validation_every
        self.validator = None

    def start(self, job) -> None:
        if job.dist.is_main or job.model.sharded:  # a sharded model samples on every rank (its forward is collective)
            self.validator = Validator(self.params, job)

    def busy_after(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def after_step(self, job, report) -> None:
        if self.validator is None or not self.validator.due(report.step):
            return
        with job.busy("validation"):
            images = self.validator.images(job)
        if not job.dist.is_main:
            return
        grid = self.validator.grid(images)
        path = self.run_dir / VALIDATION_DIR / f"step-{report.step:08d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        grid.save(path)
        report.artifacts.append((path, VALIDATION_DIR))
