"""The preflight's params: the given configuration with only its sizes shrunk.

:func:`derive_params` keeps every source, kind, filter, phase, model architecture and training option of
the configuration it is given and changes only what a small rehearsal must change:

* each source reads a local sample (``preflight_sources/<name>``, written by :mod:`sdforge.preflight.samples`
  in the kind's real on-disk format); URL sources may fetch from loopback, and at most one fetch process
  per CPU core is started (a 16-process pool on a 2-core machine only adds start-up time);
* every phase runs ``steps`` optimizer steps (one epoch of ``steps × batch × accumulation × processes``
  samples); on a CPU the per-process batch and the accumulation default to 1 — an SD1.x step at batch 1
  takes ~26 s there, batch 24 would take ten minutes — and one process trains (two 860M-parameter ranks
  do not fit in 24 GiB); the batch grows where a mix needs more samples for every source to get one;
* eval samples one prompt per category with 2 sampler steps (the grid's FID off; CLIP score with
  ``models.eval_clip``'s random stand-in), and a ControlNet phase's held-out conditions on 2 samples (a draw
  with and one without the ControlNet each); the COCO protocol (``eval.coco.phase_end_samples``) on 2 captions of
  a COCO-2014 val sample (``preflight_sources/coco_val2014``) with the stand-in scorers;
* tracking, checkpoints and DVC stay inside the workspace (no S3 remote, no checkpoint upload);
* ``models.missing_weights: random``: a VAE / text encoder whose weights are not on this machine is built
  from its real configuration with seeded random weights.

Everything here is a pure function of plain dicts: the tool that runs the preflight (``tools/preflight.py``)
does the I/O.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdforge.latents.mix import smallest_total

SAMPLES_DIR = "preflight_sources"
"""Workspace folder holding each source's sample (``<name>/``) and the HTTP-served images (``http/``)."""
HTTP_DIR = f"{SAMPLES_DIR}/http"
LOOPBACK = "127.0.0.0/8"
URL_KINDS = {"laion"}


@dataclass(frozen=True)
class Shrink:
    """How far the preflight shrinks the configuration (see the module docstring)."""

    steps: int = 2
    batch_size: int | None = None
    """Per-process batch; ``None``: 1 on CPU, the phase's own on CUDA."""
    grad_accum: int | None = None
    """``None``: 1 on CPU, the phase's own on CUDA."""
    nproc: int = 1
    cpus: int = 2
    eval_steps: int = 2
    device: str = "cpu"


def derive_params(full: dict[str, Any], shrink: Shrink, project_root: Path) -> dict[str, Any]:
    """The preflight params for ``full`` (a loaded params.yaml dict); ``full`` is not modified."""
    params = copy.deepcopy(full)
    params["tracking"] = {**params.get("tracking", {}), "mlflow_uri": "sqlite:///mlflow.db"}
    params["storage"] = {**params.get("storage", {}), "dvc_remote": None, "mlflow_artifacts": None}
    params["sources"] = {
        name: _sample_source(name, src, shrink.cpus) for name, src in params.get("sources", {}).items()
    }
    params["models"] = _local_models(params.get("models", {}), project_root)
    params["train"] = _train(params.get("train", {}), shrink)
    params["phases"] = {name: _phase(phase, shrink) for name, phase in params.get("phases", {}).items()}
    params["eval"] = _eval(params.get("eval", {}), shrink.eval_steps)
    return params


def _sample_source(name: str, source: dict[str, Any], cpus: int) -> dict[str, Any]:
    """Read the sample in ``preflight_sources/<name>``; loopback allowed for URL kinds; ≤ ``cpus`` processes."""
    source = copy.deepcopy(source)
    source["repo"] = f"{SAMPLES_DIR}/{name}"
    source["revision"] = None
    fetch = source.setdefault("fetch", {})
    if "processes" in fetch:
        fetch["processes"] = max(1, min(int(fetch["processes"]), cpus))
    if source.get("kind") in URL_KINDS:
        fetch["serve_demo"] = False
        fetch["allow_networks"] = sorted({*fetch.get("allow_networks", []), LOOPBACK})
    return source


def _local_models(models: dict[str, Any], project_root: Path) -> dict[str, Any]:
    """Local model folders made absolute (the workspace is elsewhere); missing weights built at random."""
    models = copy.deepcopy(models)
    for key in ("vae", "text_encoder", "text_encoder_2"):
        value = models.get(key)
        if isinstance(value, str) and (project_root / value).is_dir():
            models[key] = str((project_root / value).resolve())
    models["missing_weights"] = "random"
    return models


PREFLIGHT_HELD_OUT = 2
"""Held-out samples per source in the preflight (at most ``train.held_out``): the validation loss runs once per
phase, at its end, on these (its full-size cost is forecast from the measured seconds per sample)."""


CPU_HANG_TIMEOUT_S = 3600.0
"""``train.hang_timeout_s`` of a CPU preflight. The watchdog's automatic limit has no step time to scale until a
phase's second step ends (the first may compile), so it is 300 s there; a full-size step on a 2-core CPU takes
26–160 s alone and more than 300 s beside other work (a preflight's last phase was killed so, 2026-11-27)."""


def _train(train: dict[str, Any], shrink: Shrink) -> dict[str, Any]:
    """No checkpoint upload; ``shrink.nproc`` processes on one node; a small held-out set measured at phase ends;
    no post-hoc EMA (its memory and disk are forecast from the full config instead)."""
    train = copy.deepcopy(train)
    train["held_out"] = min(int(train.get("held_out", 0)), PREFLIGHT_HELD_OUT)
    train["val_loss_every"] = 0
    train["posthoc_sigma_rels"] = []  # two more fp32 UNets do not fit beside SD1.5's training in 24 GiB; forecast only
    train["checkpoint_s3"] = None
    if shrink.device == "cpu" and not train.get("hang_timeout_s"):
        train["hang_timeout_s"] = CPU_HANG_TIMEOUT_S
    train["nproc_per_node"] = shrink.nproc
    train["nnodes"] = 1
    train["node_rank"] = 0
    train["rdzv_endpoint"] = None
    return train


def phase_batch(phase: dict[str, Any], shrink: Shrink) -> tuple[int, int]:
    """The preflight's (per-process batch, accumulation) for ``phase``."""
    on_cpu = shrink.device == "cpu"
    batch = shrink.batch_size or (1 if on_cpu else int(phase.get("batch_size", 1)))
    accum = shrink.grad_accum or (1 if on_cpu else int(phase.get("grad_accum", 1)))
    return batch, accum


def _phase(phase: dict[str, Any], shrink: Shrink) -> dict[str, Any]:
    """One epoch of exactly ``shrink.steps`` optimizer steps; everything else as configured.

    The per-process batch grows where the mix needs it: ``mix_phase`` refuses a source that gets no sample,
    so the final mix (VGGFace2 at 0.09) needs 6 samples (batch 3 × 2 steps on one CPU process).
    A mix of counts becomes the same proportions as fractions.
    """
    phase = copy.deepcopy(phase)
    batch, accum = phase_batch(phase, shrink)
    mix = phase["mix"]
    if all(isinstance(v, int) for v in mix.values()):
        mix = {name: count / sum(mix.values()) for name, count in mix.items()}
    per_batch = shrink.steps * accum * shrink.nproc
    batch = max(batch, smallest_total(mix, per_batch) // per_batch)
    phase.update(mix=mix, batch_size=batch, grad_accum=accum, epochs=1, samples=per_batch * batch)
    return phase


def first_prompts(prompts: dict[str, list[str]] | list[str]) -> dict[str, list[str]] | list[str]:
    """The first prompt of each category (a plain list is one category)."""
    if isinstance(prompts, dict):
        return {category: list(items[:1]) for category, items in prompts.items()}
    return list(prompts[:1])


PREFLIGHT_COCO_SAMPLES = 2
"""Captions the COCO protocol samples at the preflight's phase ends (its full-size cost is forecast per image)."""
PREFLIGHT_CONTROL_SAMPLES = 2
"""Held-out samples a ControlNet phase's eval draws under their conditions (``eval.control_samples``): the default
8's 16 draws at 512² took 7.7 of the eval's 13 min on an AMD EPYC ×2 (~29 s a draw at 2 steps)."""
COCO_DIR = f"{SAMPLES_DIR}/coco_val2014"
"""The preflight's COCO-2014 val sample (:func:`sdforge.preflight.samples.write_coco_val`)."""


def _eval(eval_: dict[str, Any], steps: int) -> dict[str, Any]:
    """One prompt per category, ``steps`` sampler steps everywhere, the grid's FID off, a ControlNet phase's
    conditions on ``PREFLIGHT_CONTROL_SAMPLES`` held-out samples; the COCO protocol, when the configuration runs it
    at phase ends, on the preflight's COCO sample with ``PREFLIGHT_COCO_SAMPLES`` captions."""
    eval_ = copy.deepcopy(eval_)
    eval_["prompts"] = first_prompts(eval_.get("prompts", []))
    eval_["steps"] = steps
    eval_["control_samples"] = min(PREFLIGHT_CONTROL_SAMPLES, eval_.get("control_samples", PREFLIGHT_CONTROL_SAMPLES))
    eval_["sampling"] = {
        category: {**overrides, "steps": steps} if "steps" in overrides else overrides
        for category, overrides in (eval_.get("sampling") or {}).items()
    }
    eval_["clip_model_path"] = None  # the scorers are models.eval_clip / fid_inception's (random stand-ins)
    eval_["fid"] = {**(eval_.get("fid") or {}), "inception_path": None, "reference_dir": None}
    coco = eval_.get("coco") or {}
    if coco.get("phase_end_samples"):
        eval_["coco"] = {**coco, "captions": f"{COCO_DIR}/annotations/captions_val2014.json", "images":
                         f"{COCO_DIR}/val2014", "phase_end_samples": PREFLIGHT_COCO_SAMPLES,
                         "steps": steps if coco.get("steps") else None}  # fmt: skip
    return eval_


def samples_needed(params: dict[str, Any]) -> dict[str, int]:
    """Per source, the most rows any phase of ``params`` draws from it plus ``train.held_out`` (what its sample
    must hold)."""
    held_out = int(params.get("train", {}).get("held_out", 0))
    need: dict[str, int] = {name: 0 for name in params.get("sources", {})}
    for phase in params.get("phases", {}).values():
        total = int(phase["samples"])
        for source, fraction in phase["mix"].items():
            need[source] = max(need.get(source, 0), held_out + int(-(-total * float(fraction) // 1)))
    return need
