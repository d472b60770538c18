"""Stage ``prepare_models``: the frozen VAE / text encoder(s) / tokenizer(s), the noise scheduler, and the
seeded from-scratch denoiser (``models.denoiser.family``: ``model/denoisers/``) that phase 1 starts from.

Writes (each with ``save_pretrained``, safetensors)::

    ${paths.models}/vae/            AutoencoderKL
    ${paths.models}/text_encoder/   CLIPTextModel (the mmdit family: CLIPTextModelWithProjection)
    ${paths.models}/tokenizer/      CLIPTokenizer (77 tokens)
    ${paths.models}/text_encoder_2/, tokenizer_2/   the second CLIP of a family with two (mmdit: bigG)
    ${paths.models}/scheduler/      DDPMScheduler (models.noise)
    ${paths.models}/uncond_embedding.safetensors   "uncond": the family's packed conditioning of "" [1, L, D]
                                    (the CFG-dropout condition, computed once here for every phase)
    ${paths.models}/captioner/      ``models.captioner_build``: the demo's captioner (``recaption.model: build``)
    ${paths.models}/eval_clip/, fid_inception.pt   the scorers (:mod:`sdforge.eval.weights`)
    ${paths.checkpoints}/scratch/unet/       seeded denoiser, output projections zeroed (the folder keeps the
                                             first family's name whatever the family)
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
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from model.builders import count_parameters, noise_scheduler, vae_downsample_factor
from model.denoisers import family
from model.text_stack import TextStack, text_part_dirs
from sdforge.architectures.pretrained import check_text_widths, load_pretrained_text, load_pretrained_vae
from sdforge.captions.models import BUILT_CAPTIONER
from sdforge.config import SCRATCH, DemoData, Eval, Models, Params
from sdforge.demo.models import build_demo_captioner, build_demo_components
from sdforge.eval.weights import prepare_eval_weights
from sdforge.io import fresh_folder, stage_cli, write_json
from sdforge.tracking import log_stage

log = logging.getLogger(__name__)

VAE, TEXT_ENCODER, TOKENIZER, SCHEDULER = "vae", "text_encoder", "tokenizer", "scheduler"
UNCOND_EMBEDDING = "uncond_embedding.safetensors"
UNET, UNET_EMA, STATE = "unet", "unet_ema", "state.json"


def _fresh(path: Path) -> Path:
    """An empty ``<path>.tmp`` sibling to write into before :func:`_publish`."""
    return fresh_folder(path.with_name(path.name + ".tmp"), "the models", setting="paths.models")


def _publish(tmp: Path, path: Path) -> None:
    """Replace ``path`` with the completed ``tmp`` folder."""
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def save_uncond_embedding(text: TextStack, path: Path) -> torch.Tensor:
    """Encode the empty prompt once (the packed ``[1, L, D]`` fp32, on the CPU) and save it as ``{"uncond": ...}``."""
    uncond = text.encode_prompts([""]).float().contiguous()
    save_file({"uncond": uncond}, path)
    return uncond


def run(
    models: Models,
    demo: DemoData,
    eval_: Eval | None,
    models_dir: str | Path,
    scratch_dir: str | Path,
) -> dict[str, Any]:
    """Write the frozen components to ``models_dir`` and the seeded denoiser to ``scratch_dir``; return metrics."""
    t0 = time.perf_counter()
    models_dir, scratch_dir = Path(models_dir), Path(scratch_dir)
    out, scratch = _fresh(models_dir), _fresh(scratch_dir)
    metrics: dict[str, Any] = {"source": models.source, "denoiser_family": models.denoiser.family}
    denoiser_family = family(models.denoiser.family)
    config = denoiser_family.config(models.denoiser_spec)

    if models.source == "build":
        tokenizers, encoders, vae = build_demo_components(models, demo, eval_, out, denoiser_family, metrics)
    else:
        tokenizers, encoders = load_pretrained_text(models, denoiser_family, out, metrics)
        vae = load_pretrained_vae(models, metrics)
    check_text_widths(denoiser_family, config, encoders)
    text = TextStack(denoiser_family, tokenizers, encoders)

    vae.save_pretrained(out / VAE, safe_serialization=True)
    for encoder, (encoder_dir, _) in zip(encoders, text_part_dirs(denoiser_family), strict=True):
        encoder.save_pretrained(out / encoder_dir, safe_serialization=True)
    noise_scheduler(models.noise.model_dump()).save_pretrained(out / SCHEDULER)
    save_uncond_embedding(text, out / UNCOND_EMBEDDING)
    metrics.update(build_demo_captioner(models, demo, out / BUILT_CAPTIONER))
    metrics.update(prepare_eval_weights(models, out))  # models.eval_clip / fid_inception: the scorers' weights

    unet = denoiser_family.build(config, models.seed)
    unet.save_pretrained(scratch / UNET, safe_serialization=True)
    unet.save_pretrained(scratch / UNET_EMA, safe_serialization=True)
    write_json(scratch / STATE, {"phase": SCRATCH, "step": 0})

    _publish(out, models_dir)
    _publish(scratch, scratch_dir)
    metrics.update(
        vae_params=count_parameters(vae),
        vae_scaling_factor=float(vae.config.scaling_factor),
        vae_downsample=vae_downsample_factor(vae),
        pixel_size=denoiser_family.trained_side(unet, vae_downsample_factor(vae)),
        text_encoder_params=sum(count_parameters(e) for e in encoders),
        text_hidden_size=sum(int(e.config.hidden_size) for e in encoders),
        tokenizer_vocab_size=len(tokenizers[0]),
        tokenizer_max_length=tokenizers[0].model_max_length,
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
        f"{metrics['text_encoder_params']:,}, {models.denoiser.family} denoiser {metrics['unet_params']:,} "
        f"(seeded, `{SCRATCH}`)"
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
