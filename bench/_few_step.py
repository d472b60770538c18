"""Few-step sampling figures for :mod:`bench.demo_quality`: a distilled phase (``phases.<p>.distill``) at its own
steps against its teacher (the ``init_from`` phase) at many and at as few steps (issue 42).

The seen prompts, each with ``REPEATS`` noise seeds (``eval.seed + i``): 16 prompts give agreement in steps of
1/16; 64 images in steps of 1/64. Each sampler's colour and shape agreement (the demo probe), UNet calls per image
(steps × 2 with classifier-free guidance, × 1 without) and wall time per image on this machine, in one process one
after the other.
"""

from __future__ import annotations

import time
from pathlib import Path

from sdforge.config import Params
from sdforge.eval.grid import probe_agreement
from sdforge.eval.sampling import few_step_settings, generate, load_pipeline

REPEATS = 4
TEACHER_STEPS = 50
"""The teacher's many-step reference (issue 42: "the teacher's 50-step DDIM"; a flow-matching teacher's sampler is
the Euler step, which is DDIM for that objective)."""


def sampler_figures(params: Params, phase: str, steps: int, guidance: float, prompts: list[str]) -> dict:
    """Probe agreement, UNet calls and seconds per image of ``phase``'s EMA weights at ``steps`` / ``guidance``."""
    pipe = load_pipeline(Path(params.paths.models), Path(params.paths.checkpoints) / phase, device="cpu")
    seeds = [params.eval.seed + i for i in range(len(prompts))]
    start = time.perf_counter()
    images = generate(pipe, prompts, steps=steps, guidance_scale=guidance, seeds=seeds, batch_size=16)
    seconds = (time.perf_counter() - start) / len(images)
    probe = probe_agreement(images, prompts, params.demo)
    return {
        "steps": steps,
        "guidance": guidance,
        "colour": probe["colour_agreement_seen"],
        "shape": probe["shape_agreement_seen"],
        "unet_calls": steps * (2 if guidance > 1 else 1),
        "ms_per_image": round(1000 * seconds, 1),
    }


def few_step_study(params: Params, student: str) -> dict:
    """``teacher_many``, ``teacher_few``, ``teacher_same_calls`` and ``student`` figures (:func:`sampler_figures`)
    for distilled phase ``student``: ``teacher_few`` takes the student's steps with the eval's guidance (twice the
    UNet calls: CFG), ``teacher_same_calls`` half of them (the student's UNet calls)."""
    teacher = params.phases[student].init_from
    prompts = [p for p in params.eval.prompts["seen"] for _ in range(REPEATS)]
    pipe = load_pipeline(Path(params.paths.models), Path(params.paths.checkpoints) / student, device="cpu")
    steps, guidance = few_step_settings(pipe) or (params.phases[student].distill.sampling_steps, 1.0)
    return {
        "teacher": teacher,
        "teacher_many": sampler_figures(params, teacher, TEACHER_STEPS, params.eval.guidance_scale, prompts),
        "teacher_few": sampler_figures(params, teacher, steps, params.eval.guidance_scale, prompts),
        "teacher_same_calls": sampler_figures(
            params, teacher, max(1, steps // 2), params.eval.guidance_scale, prompts
        ),  # fmt: skip
        "student": sampler_figures(params, student, steps, guidance, prompts),
    }


def share_of_teacher(study: dict) -> float:
    """The student's lower probe figure as a share of the many-step teacher's (colour and shape; 1 = as good)."""
    many, mine = study["teacher_many"], study["student"]
    return min(mine[k] / many[k] if many[k] else 1.0 for k in ("colour", "shape"))


def lines(study: dict) -> list[str]:
    """One printed row per sampler."""
    rows = []
    for name in ("teacher_many", "teacher_few", "teacher_same_calls", "student"):
        f = study[name]
        rows.append(
            f"  {name:12s} {f['steps']:3d} steps, guidance {f['guidance']:.1f}: colour {f['colour']:.1%} shape "
            f"{f['shape']:.1%}, {f['unet_calls']} UNet calls/img, {f['ms_per_image']:.1f} ms/img"
        )
    return rows
