"""Export a phase checkpoint as a diffusers ``StableDiffusionPipeline`` folder (``sdforge export``).

The folder holds the EMA UNet (``--live``: the live weights), the frozen VAE, text encoder and
tokenizer, and the scheduler that ``sdforge generate`` samples with — DDIM with the training betas and
``clip_sample=False`` for a diffusion phase, the flow-matching Euler sampler for a flow-matching one
(:func:`model.sampler.sampling_scheduler`) — all as safetensors; no safety checker
(``requires_safety_checker=False``). An adapter phase with ``adapter.merge: false`` is exported with its
adapter fused into the UNet (the LoRA file itself is the phase's ``adapter_ema/``).
``StableDiffusionPipeline.from_pretrained(folder)`` loads it, and with the same seed (a CPU
generator), steps and guidance it reproduces ``sdforge generate``'s image.

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
from sdforge.eval.sampling import load_pipeline
from sdforge.tracking import stage_run

log = logging.getLogger(__name__)

MODEL_ARTIFACT = "diffusers_pipeline"


def export_pipeline(models_dir: Path, checkpoint_dir: Path, out_dir: Path, use_ema: bool = True) -> dict:
    """Write the diffusers folder to ``out_dir`` (replaced whole, via a sibling temp folder); return metrics."""
    pipe = load_pipeline(models_dir, checkpoint_dir, use_ema=use_ema, device="cpu")
    if getattr(pipe.unet, "peft_config", None):  # an unmerged adapter: fuse it, drop the LoRA layers
        pipe.unet.fuse_lora()
        pipe.unet.unload_lora()
    sd = StableDiffusionPipeline(
        vae=pipe.vae,
        text_encoder=pipe.text_encoder,
        tokenizer=pipe.tokenizer,
        unet=pipe.unet,
        scheduler=sampling_scheduler(pipe.train_scheduler_config, pipe.objective, pipe.flow_shift),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    sd.save_pretrained(tmp, safe_serialization=True)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    log.info("exported %s (%s weights) to %s", checkpoint_dir, "EMA" if use_ema else "live", out_dir)
    return {
        "export_dir": str(out_dir),
        "checkpoint": str(checkpoint_dir),
        "checkpoint_hash": pipe.checkpoint_hash,
        "weights": "ema" if use_ema else "live",
        "image_size": int(sd.unet.config.sample_size * sd.vae_scale_factor),
    }


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
