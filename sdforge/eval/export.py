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

``--mlflow-register NAME`` logs the folder as the artifacts of an MLflow run (``export`` under the
parent run ``export``) and creates a version of registered model ``NAME`` whose source is them.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from diffusers import StableDiffusionPipeline

from model.sampler import sampling_scheduler
from sdforge.config import ConfigError, Tracking
from sdforge.eval.sampling import LORA_FILE, few_step_settings, load_pipeline, unmerged_adapter
from sdforge.io import InputError
from sdforge.tracking import stage_run

log = logging.getLogger(__name__)

MODEL_ARTIFACT = "diffusers_pipeline"


def export_pipeline(
    models_dir: Path, checkpoint_dir: Path, out_dir: Path, use_ema: bool = True, keep_lora: bool = False
) -> dict:
    """Write the diffusers folder to ``out_dir`` (replaced whole, via a sibling temp folder); return metrics.

    ``keep_lora``: the base UNet plus the unmerged adapter's LoRA file at the root instead of the fused UNet; an
    :class:`InputError` when the phase has no unmerged adapter."""
    adapter = unmerged_adapter(checkpoint_dir, use_ema)
    if keep_lora and adapter is None:
        raise InputError(
            f"{checkpoint_dir}: no unmerged adapter to keep as a LoRA file (its state.json has no adapter with "
            "merge: false); export it without --lora-file"
        )
    pipe = load_pipeline(models_dir, checkpoint_dir, use_ema=use_ema, device="cpu", fuse_adapter=not keep_lora)
    if keep_lora:  # the base UNet goes to unet/: drop the (unfused) LoRA layers, the weights stay the base's
        pipe.unet.unload_lora()
    scheduler = sampling_scheduler(pipe.train_scheduler_config, pipe.objective, pipe.flow_shift, pipe.distill)
    sd = StableDiffusionPipeline(
        vae=pipe.vae,
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
        unet=pipe.unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    sd.save_pretrained(tmp, safe_serialization=True)
    if keep_lora:
        shutil.copyfile(adapter / LORA_FILE, tmp / LORA_FILE)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    log.info("exported %s (%s weights) to %s", checkpoint_dir, "EMA" if use_ema else "live", out_dir)
    return {
        "export_dir": str(out_dir),
        "checkpoint": str(checkpoint_dir),
        "checkpoint_hash": pipe.checkpoint_hash,
        "weights": "ema" if use_ema else "live",
        "image_size": int(sd.unet.config.sample_size * sd.vae_scale_factor),
        "scheduler": type(scheduler).__name__,
        **({"adapter": "lora_file" if keep_lora else "fused"} if adapter is not None else {}),
        **_few_step_metrics(pipe),
    }


def _few_step_metrics(pipe) -> dict:
    """``sampling_steps`` and ``guidance_scale`` a distilled phase's export samples with; ``{}`` otherwise."""
    settings = few_step_settings(pipe)
    return {} if settings is None else {"sampling_steps": settings[0], "guidance_scale": settings[1]}


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
