"""Export a phase checkpoint as a diffusers ``StableDiffusionPipeline`` folder (``sdforge export``).

The folder holds the EMA UNet (``--live``: the live weights), the frozen VAE, text encoder and
tokenizer, and the scheduler that ``sdforge generate`` samples with — DDIM with the training betas and
``clip_sample=False`` for a diffusion phase, ``LCMScheduler`` for a consistency-distilled (``distill``)
diffusion phase, the flow-matching Euler sampler for a flow-matching one (its stochastic variant when distilled)
(:func:`model.sampler.sampling_scheduler`) — all as safetensors; no safety checker
(``requires_safety_checker=False``). With the same seeds (CPU generators, one per image), steps and guidance
the folder reproduces ``sdforge generate``'s images pixel for pixel. A distilled phase samples with its
``distill.sampling_steps`` and ``guidance_scale=1`` (``metrics``: ``sampling_steps``, ``guidance_scale``).

An adapter phase with ``adapter.merge: false`` (e.g. an LCM-LoRA) is exported in one of two forms:

- default, fused: the adapter fused into ``unet/``; ``StableDiffusionPipeline.from_pretrained(folder)`` is the
  whole model and draws what ``sdforge generate --fuse-lora`` draws;
- ``keep_lora`` (``sdforge export --lora-file``): ``unet/`` is the base UNet unchanged and the folder root
  holds the adapter as ``pytorch_lora_weights.safetensors`` (a copy of the phase's ``adapter_ema/`` file;
  ``--live``: ``adapter/``); ``StableDiffusionPipeline.from_pretrained(folder)`` followed by
  ``pipe.load_lora_weights(folder)`` rebuilds it and draws what ``sdforge generate`` draws.

A ControlNet phase (``phases.<p>.controlnet``) exports its base pipeline with ``controlnet/`` beside it (the
ControlNet, ``ControlNetModel.from_pretrained``): ``StableDiffusionControlNetPipeline.from_pretrained(folder,
controlnet=…)`` called with ``controlnet_conditioning_scale`` (``sdforge_export.json``: ``controlnet``) draws what
``sdforge generate --control-image`` draws.

``--mlflow-register NAME`` logs the folder as the artifacts of an MLflow run (``export`` under the
parent run ``export``) and creates a version of registered model ``NAME`` whose source is them.

The folder is written beside ``--out`` (``.<name>.export-<random>/``), ``sdforge_export.json`` last, and renamed
into place: an export is complete or absent. ``--out`` must be new, an empty folder, or — with ``--overwrite`` —
a previous export (it holds ``sdforge_export.json`` and only what an export writes); it must not overlap the
workspace's folders or contain the workspace (:mod:`sdforge.eval.export_target`, docs/RESILIENCE.md "What deletes
what").
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from sdforge.config import ConfigError, Tracking
from sdforge.eval.export_target import EXPORT_MARKER
from sdforge.eval.sampling import LORA_FILE, few_step_settings, load_pipeline, trained_side, unmerged_adapter
from sdforge.eval.text_lora import unload_text_lora
from sdforge.io import InputError, write_json
from sdforge.output_dirs import (
    check_replaceable,
    fresh_sibling,
    refuse_workspace_target,
    resolved,
    unexpected_entries,
    warn_leftovers,
)
from sdforge.tracking import stage_run

log = logging.getLogger(__name__)

MODEL_ARTIFACT = "diffusers_pipeline"
CONTROLNET_DIR = "controlnet"
"""A ControlNet phase's ControlNet in an export, beside the base pipeline (``ControlNetModel.from_pretrained``)."""
EXPORT_ENTRIES = frozenset({
    "model_index.json", "unet", "transformer", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2",
    "text_encoder_3", "tokenizer_3", "scheduler", "safety_checker", "feature_extractor", "image_encoder", LORA_FILE,
    CONTROLNET_DIR, EXPORT_MARKER,
})  # fmt: skip
"""What an export may hold at its top (the family's pipeline components, the LoRA file, the marker)."""
TEMP_TAG, REPLACED_TAG = "export", "replaced"


def _check_previous(out_dir: Path, overwrite: bool) -> bool:
    """Whether ``out_dir`` holds a previous export to replace (an :class:`InputError` if it holds anything
    else, or one without ``overwrite``)."""
    if not check_replaceable(out_dir, EXPORT_MARKER, "export", "--out", overwrite):
        return False
    foreign = unexpected_entries(out_dir, EXPORT_ENTRIES)
    if foreign:
        raise InputError(
            f"--out {out_dir}: a previous export that also holds {', '.join(foreign)}, which an export does not "
            "write; move them out of it, or pick a new folder"
        )
    return True


def export_pipeline(
    models_dir: Path,
    checkpoint_dir: Path,
    out_dir: Path,
    use_ema: bool = True,
    keep_lora: bool = False,
    overwrite: bool = False,
) -> dict:
    """Write the diffusers folder and its ``sdforge_export.json`` to ``out_dir``; return the metrics.

    ``out_dir`` must be new, an empty folder or (``overwrite``) a previous export, and must not overlap the
    ``models_dir`` or ``checkpoint_dir`` read (:class:`InputError` otherwise, before anything is loaded). The
    folder is written beside it and renamed into place; a previous export is moved aside first and removed
    once the new one is in place. On any failure ``out_dir`` is left as it was and the temp folder removed.

    ``keep_lora``: the base UNet plus the unmerged adapter's LoRA file at the root instead of the fused UNet; an
    :class:`InputError` when the phase has no unmerged adapter."""
    inputs = {f"the models folder {models_dir}": resolved(models_dir),
              f"the checkpoint {checkpoint_dir}": resolved(checkpoint_dir)}  # fmt: skip
    refuse_workspace_target(out_dir, "--out", inputs, [])
    _check_previous(out_dir, overwrite)
    adapter = unmerged_adapter(checkpoint_dir, use_ema)
    if keep_lora and adapter is None:
        raise InputError(
            f"{checkpoint_dir}: no unmerged adapter to keep as a LoRA file (its state.json has no adapter with "
            "merge: false); export it without --lora-file"
        )
    pipe = load_pipeline(models_dir, checkpoint_dir, use_ema=use_ema, device="cpu", fuse_adapter=not keep_lora)
    if keep_lora:  # the base UNet and encoders are written: drop the (unfused) LoRA layers, the weights stay the base's
        pipe.unet.unload_lora()
        for encoder in pipe.text.encoders:
            unload_text_lora(encoder)
    sd = pipe.family.pipeline(pipe.denoiser, pipe.vae, pipe.text.encoders, pipe.text.tokenizers, pipe.scheduler())
    metrics = {
        "export_dir": str(out_dir),
        "checkpoint": str(checkpoint_dir),
        "checkpoint_hash": pipe.checkpoint_hash,
        "weights": "ema" if use_ema else "live",
        "pipeline": type(sd).__name__,
        "image_size": trained_side(pipe),
        "scheduler": type(sd.scheduler).__name__,
        **({"call": pipe.family.pipeline_call} if pipe.family.pipeline_call else {}),
        **({"load": pipe.family.pipeline_load} if pipe.family.pipeline_load else {}),
        **({"adapter": "lora_file" if keep_lora else "fused"} if adapter is not None else {}),
        **_few_step_metrics(pipe),
        **_controlnet_metrics(pipe),
    }
    controlnet = pipe.unet.controlnet if pipe.controlnet is not None else None
    _write(sd, adapter / LORA_FILE if keep_lora else None, metrics, out_dir, overwrite, controlnet)
    log.info("exported %s (%s weights) to %s", checkpoint_dir, "EMA" if use_ema else "live", out_dir)
    return metrics


def _write(sd, lora_file: Path | None, metrics: dict, out_dir: Path, overwrite: bool, controlnet=None) -> None:
    """Save ``sd`` (and ``lora_file``, and ``controlnet`` as ``controlnet/``) into a new temp folder beside
    ``out_dir``, the marker last, and rename it into place; on any failure remove the temp folder (ours) and leave
    ``out_dir`` as it was."""
    target = resolved(out_dir)  # written at the real folder: a symlink given as --out stays a link to it
    warn_leftovers(target, [TEMP_TAG, REPLACED_TAG])
    tmp = fresh_sibling(target, TEMP_TAG)
    try:
        sd.save_pretrained(tmp, safe_serialization=True)
        if lora_file is not None:
            shutil.copyfile(lora_file, tmp / LORA_FILE)
        if controlnet is not None:
            controlnet.save_pretrained(tmp / CONTROLNET_DIR, safe_serialization=True)
        write_json(tmp / EXPORT_MARKER, metrics)  # last: a folder with the marker is a whole export
        _publish(tmp, target, replace=_check_previous(out_dir, overwrite))  # checked again: minutes went by
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # our own temp folder, nothing else
        raise


def _publish(tmp: Path, out_dir: Path, replace: bool) -> None:
    """Rename the finished ``tmp`` to ``out_dir`` (absent, or an empty folder, which the rename replaces); with
    ``replace``, the previous export is moved aside first, put back if the rename fails, removed after."""
    if not replace:
        tmp.rename(out_dir)
        return
    aside = fresh_sibling(out_dir, REPLACED_TAG)
    out_dir.rename(aside / out_dir.name)
    try:
        tmp.rename(out_dir)
    except BaseException:
        (aside / out_dir.name).rename(out_dir)
        aside.rmdir()
        raise
    shutil.rmtree(aside)  # holds only the previous export, proven ours by _check_previous


def _few_step_metrics(pipe) -> dict:
    """``sampling_steps`` and ``guidance_scale`` a distilled phase's export samples with; ``{}`` otherwise."""
    settings = few_step_settings(pipe)
    return {} if settings is None else {"sampling_steps": settings[0], "guidance_scale": settings[1]}


def _controlnet_metrics(pipe) -> dict:
    """A ControlNet phase's export: where its ControlNet is, the pipeline that samples under it and the call's
    scale (``controlnet``); ``{}`` otherwise."""
    if pipe.controlnet is None:
        return {}
    return {"controlnet": {**pipe.controlnet, "folder": CONTROLNET_DIR, "pipeline": pipe.family.controlnet_pipeline,
                           "call": {"controlnet_conditioning_scale": pipe.controlnet["conditioning_scale"]}}}


def register(export_dir: Path, name: str, tracking: Tracking, metrics: dict) -> dict:
    """Log ``export_dir`` as run artifacts and register them as a new version of model ``name``."""
    if not tracking.enabled:
        raise ConfigError(f"registering model '{name}' needs MLflow: set tracking.enabled: true in params")
    with stage_run(tracking, parent="export", stage="export", params=metrics) as mlflow:
        mlflow.log_artifacts(str(export_dir), artifact_path=MODEL_ARTIFACT)
        run = mlflow.active_run()
        client = mlflow.MlflowClient()
        try:
            client.get_registered_model(name)
        except mlflow.exceptions.MlflowException:
            client.create_registered_model(name, description="sdforge StableDiffusionPipeline (diffusers folder)")
        version = client.create_model_version(
            name,
            source=f"{run.info.artifact_uri}/{MODEL_ARTIFACT}",
            run_id=run.info.run_id,
            tags={"checkpoint_hash": metrics["checkpoint_hash"], "weights": metrics["weights"]},
        )
    log.info("registered %s version %s (run %s)", name, version.version, run.info.run_id)
    return {"registered_model": name, "model_version": int(version.version), "run_id": run.info.run_id}
