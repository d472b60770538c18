"""Stage ``prepare_models``: the frozen VAE / text encoder / tokenizer, the noise scheduler, and the
seeded from-scratch UNet that phase 1 starts from.

Writes (each with ``save_pretrained``, safetensors)::

    ${paths.models}/vae/            AutoencoderKL
    ${paths.models}/text_encoder/   CLIPTextModel
    ${paths.models}/tokenizer/      CLIPTokenizer (77 tokens)
    ${paths.models}/scheduler/      DDPMScheduler (models.noise)
    ${paths.models}/uncond_embedding.safetensors   "uncond": text encoder output for "" [1, 77, D]
                                    (the CFG-dropout condition, computed once here for every phase)
    ${paths.models}/captioner/      ``models.captioner_build``: the demo's captioner (``recaption.model: build``)
    ${paths.models}/eval_clip/, fid_inception.pt   the scorers (:mod:`sdforge.eval.weights`)
    ${paths.checkpoints}/scratch/unet/       seeded UNet, output projections zeroed
    ${paths.checkpoints}/scratch/unet_ema/   the same weights (EMA starts at the live weights)
    ${paths.checkpoints}/scratch/state.json  {"phase": "scratch", "step": 0}

``models.source: pretrained`` loads the VAE and text encoder + tokenizer with ``from_pretrained``
(hub ids at full scale; local folders work the same) and re-saves them, pinning the snapshot
under DVC. With ``models.missing_weights: random`` (``sdforge preflight`` only) a component that no local
folder or Hugging Face cache holds is built instead (:mod:`sdforge.architectures`: the real architecture,
seeded random weights, CLIP's real tokenizer); metrics ``vae_weights`` / ``text_encoder_weights`` say
``pretrained`` or ``random``. ``models.source: build`` (the demo) makes a tokenizer whose vocabulary holds every
demo word as one token, a seeded tiny text encoder, and a tiny VAE trained here on freshly
rendered demo shapes (:mod:`sdforge.demo.models`).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL
from safetensors.torch import save_file
from transformers import CLIPTextModel, CLIPTokenizer

from model.builders import build_unet, count_parameters, noise_scheduler, unet_config, vae_downsample_factor
from model.sampler import encode_prompts
from sdforge.architectures import build_random_text_encoder, build_random_vae, write_clip_tokenizer
from sdforge.captions.models import BUILT_CAPTIONER
from sdforge.config import SCRATCH, ConfigError, DemoData, Eval, Models, Params
from sdforge.demo.models import build_demo_captioner, build_demo_components
from sdforge.eval.weights import prepare_eval_weights
from sdforge.io import fresh_folder, stage_cli, write_json
from sdforge.tracking import log_stage

log = logging.getLogger(__name__)

VAE, TEXT_ENCODER, TOKENIZER, SCHEDULER = "vae", "text_encoder", "tokenizer", "scheduler"
UNCOND_EMBEDDING = "uncond_embedding.safetensors"
UNET, UNET_EMA, STATE = "unet", "unet_ema", "state.json"
MIN_BPE_TOKENS = 256
"""A byte-level BPE vocabulary holds at least the 256 byte characters; fewer: no tokenizer files were found."""


def check_cross_attention(unet_cross_attention_dim: int, text_hidden_size: int) -> None:
    """The UNet's cross-attention reads the text encoder's hidden states: the widths must agree."""
    if unet_cross_attention_dim != text_hidden_size:
        raise ConfigError(
            f"models.unet.cross_attention_dim ({unet_cross_attention_dim}) must equal the text encoder's "
            f"hidden size ({text_hidden_size})"
        )


def _fresh(path: Path) -> Path:
    """An empty ``<path>.tmp`` sibling to write into before :func:`_publish`."""
    return fresh_folder(path.with_name(path.name + ".tmp"), "the models", setting="paths.models")


def _publish(tmp: Path, path: Path) -> None:
    """Replace ``path`` with the completed ``tmp`` folder."""
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def _from_pretrained(load: Callable[..., Any], key: str, name: str, local_only: bool) -> Any | None:
    """``load(name)``. ``local_only`` (``missing_weights: random``): local files only, and None with a WARNING
    when no local folder or cache holds them; otherwise a :class:`ConfigError` naming ``models.<key>``."""
    try:
        loaded = load(name, local_files_only=True) if local_only else load(name)
        if isinstance(loaded, CLIPTokenizer) and len(loaded) < MIN_BPE_TOKENS:  # transformers 5 does not raise
            raise OSError(f"no tokenizer files (from_pretrained gave a {len(loaded)}-token placeholder)")
        return loaded
    except (OSError, ValueError) as err:
        if not local_only:
            raise ConfigError(f"models.{key}: cannot load {name!r} with from_pretrained: {err} "
                              "(models.missing_weights: random builds a random stand-in, for preflight only)") from err
        log.warning("models.%s: %r is not on this machine (%s); models.missing_weights: random builds its "
                    "architecture with random weights: fine for a preflight, never for a real run", key, name, err)
        return None


def _load_pretrained_components(
    models: Models, out: Path, metrics: dict[str, Any]
) -> tuple[CLIPTokenizer, CLIPTextModel, AutoencoderKL]:
    """Full scale: the hub (or local) VAE, CLIP text encoder and tokenizer, via ``from_pretrained``; with
    ``missing_weights: random``, seeded random stand-ins for those not on this machine."""
    local_only = models.missing_weights == "random"
    text_encoder = _from_pretrained(CLIPTextModel.from_pretrained, TEXT_ENCODER, models.text_encoder, local_only)
    metrics["text_encoder_weights"] = "random" if text_encoder is None else "pretrained"
    if text_encoder is None:
        text_encoder = build_random_text_encoder(models.text_encoder, models.seed)
    check_cross_attention(models.unet.cross_attention_dim, text_encoder.config.hidden_size)
    tokenizer = _from_pretrained(CLIPTokenizer.from_pretrained, TEXT_ENCODER, models.text_encoder, local_only)
    if tokenizer is None:
        tokenizer = write_clip_tokenizer(out / TOKENIZER, text_encoder.config.max_position_embeddings)
    else:
        tokenizer.save_pretrained(out / TOKENIZER)
    vae = _from_pretrained(AutoencoderKL.from_pretrained, VAE, models.vae, local_only)
    metrics["vae_weights"] = "random" if vae is None else "pretrained"
    return tokenizer, text_encoder, build_random_vae(models.vae, models.seed) if vae is None else vae


def save_uncond_embedding(tokenizer: CLIPTokenizer, text_encoder: CLIPTextModel, path: Path) -> torch.Tensor:
    """Encode the empty prompt once (``[1, 77, D]`` fp32, on the CPU) and save it as ``{"uncond": ...}``."""
    with torch.no_grad():
        uncond = encode_prompts(tokenizer, text_encoder, [""], "cpu").float().contiguous()
    save_file({"uncond": uncond}, path)
    return uncond


def run(
    models: Models,
    demo: DemoData,
    eval_: Eval | None,
    models_dir: str | Path,
    scratch_dir: str | Path,
) -> dict[str, Any]:
    """Write the frozen components to ``models_dir`` and the seeded UNet to ``scratch_dir``; return metrics."""
    t0 = time.perf_counter()
    models_dir, scratch_dir = Path(models_dir), Path(scratch_dir)
    out, scratch = _fresh(models_dir), _fresh(scratch_dir)
    metrics: dict[str, Any] = {"source": models.source}

    if models.source == "build":
        check_cross_attention(models.unet.cross_attention_dim, models.text_encoder_build.hidden_size)
        tokenizer, text_encoder, vae = build_demo_components(models, demo, eval_, out / TOKENIZER, metrics)
    else:
        tokenizer, text_encoder, vae = _load_pretrained_components(models, out, metrics)

    vae.save_pretrained(out / VAE, safe_serialization=True)
    text_encoder.save_pretrained(out / TEXT_ENCODER, safe_serialization=True)
    noise_scheduler(models.noise.model_dump()).save_pretrained(out / SCHEDULER)
    save_uncond_embedding(tokenizer, text_encoder, out / UNCOND_EMBEDDING)
    metrics.update(build_demo_captioner(models, demo, out / BUILT_CAPTIONER))
    metrics.update(prepare_eval_weights(models, out))  # models.eval_clip / fid_inception: the scorers' weights

    unet = build_unet(unet_config(models.unet.model_dump()), models.seed)
    unet.save_pretrained(scratch / UNET, safe_serialization=True)
    unet.save_pretrained(scratch / UNET_EMA, safe_serialization=True)
    write_json(scratch / STATE, {"phase": SCRATCH, "step": 0})

    _publish(out, models_dir)
    _publish(scratch, scratch_dir)
    metrics.update(
        vae_params=count_parameters(vae),
        vae_scaling_factor=float(vae.config.scaling_factor),
        vae_downsample=vae_downsample_factor(vae),
        pixel_size=models.unet.sample_size * vae_downsample_factor(vae),
        text_encoder_params=count_parameters(text_encoder),
        text_hidden_size=text_encoder.config.hidden_size,
        tokenizer_vocab_size=len(tokenizer),
        tokenizer_max_length=tokenizer.model_max_length,
        unet_params=count_parameters(unet),
        seconds=round(time.perf_counter() - t0, 2),
    )
    return metrics


def run_stage(params: Params, _item: None) -> dict[str, Any]:
    """Resolve the paths from ``params``, run, log to the ``models`` parent run in MLflow."""
    models = params.models
    metrics = run(models, params.demo, params.eval, params.paths.models, Path(params.paths.checkpoints) / SCRATCH)
    headline = [k for k in metrics if k.endswith("_params") or k.startswith(("vae_recon", "vae_probe"))]
    note = (
        f"**Models** (`{params.paths.models}`, {models.source}): VAE {metrics['vae_params']:,} params, text encoder "
        f"{metrics['text_encoder_params']:,}, UNet {metrics['unet_params']:,} (seeded, `{SCRATCH}`)"
    )
    if "vae_recon_mae" in metrics:
        note += f"; VAE reconstruction MAE {metrics['vae_recon_mae']:.3g} (0–255)"
    dumped = {"models": models.model_dump()}
    log_stage(params.tracking, "models", "prepare_models", metrics, dumped, headline=headline, note=note)
    return metrics


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.prepare_models --params params.yaml``."""
    stage_cli("prepare_models", run_stage, needs_item=False, argv=argv)


if __name__ == "__main__":
    main()
