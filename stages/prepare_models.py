"""Stage ``prepare_models``: the frozen VAE / text encoder / tokenizer, the noise scheduler, and the
seeded from-scratch UNet that phase 1 starts from.

Writes (each with ``save_pretrained``, safetensors)::

    ${paths.models}/vae/            AutoencoderKL
    ${paths.models}/text_encoder/   CLIPTextModel
    ${paths.models}/tokenizer/      CLIPTokenizer (77 tokens)
    ${paths.models}/scheduler/      DDPMScheduler (models.noise)
    ${paths.models}/uncond_embedding.safetensors   "uncond": text encoder output for "" [1, 77, D]
                                    (the CFG-dropout condition, computed once here for every phase)
    ${paths.checkpoints}/scratch/unet/       seeded UNet, output projections zeroed
    ${paths.checkpoints}/scratch/unet_ema/   the same weights (EMA starts at the live weights)
    ${paths.checkpoints}/scratch/state.json  {"phase": "scratch", "step": 0}

``models.source: pretrained`` loads the VAE and text encoder + tokenizer with ``from_pretrained``
(hub ids at full scale; local folders work the same) and re-saves them, pinning the snapshot
under DVC. ``models.source: build`` (the demo) makes a tokenizer whose vocabulary holds every
demo word as one token, a seeded tiny text encoder, and a tiny VAE trained here on freshly
rendered demo shapes; its reconstruction is scored with ``demo_shapes.probe``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextModel, CLIPTokenizer

from model.builders import (
    build_tiny_text_encoder,
    build_tiny_vae,
    build_unet,
    clip_vocab_and_merges,
    count_parameters,
    noise_scheduler,
    seeded,
    unet_config,
    vae_downsample_factor,
)
from model.sampler import encode_prompts
from model.vae_training import latent_scaling_factor, reconstruct, train_vae
from stages.common import stage_cli, write_json
from stages.config import SCRATCH, ConfigError, DemoData, Eval, Models, Tracking
from stages.demo_shapes import ShapeSpec, probe, random_spec, render

log = logging.getLogger(__name__)

VAE, TEXT_ENCODER, TOKENIZER, SCHEDULER = "vae", "text_encoder", "tokenizer", "scheduler"
UNCOND_EMBEDDING = "uncond_embedding.safetensors"
UNET, UNET_EMA, STATE = "unet", "unet_ema", "state.json"
CAPTION_WORDS = ("a", "on", "background")
VAE_EVAL_IMAGES = 128
VAE_CALIBRATION_IMAGES = 256
# independent RNG streams under models.seed
_TRAIN_STREAM, _EVAL_STREAM, _CALIBRATION_STREAM = 1, 2, 3


# ------------------------------------------------------------------------------- demo components


def demo_words(demo: DemoData, eval_: Eval | None = None) -> list[str]:
    """Every word of a demo caption and of the eval prompts, in first-seen order, lower-cased."""
    text = [
        ShapeSpec(shape=s, colour=c, background=b).caption()
        for c in demo.colours
        for s in demo.shapes
        for b in demo.backgrounds
    ]
    if eval_ is not None:
        text += [*eval_.all_prompts, eval_.negative_prompt]
    words = [w.lower() for line in text for w in re.findall(r"[^\W\d_]+", line)]
    return list(dict.fromkeys([*CAPTION_WORDS, *words]))


def write_demo_tokenizer(words: list[str], out_dir: Path, max_length: int) -> CLIPTokenizer:
    """Write ``vocab.json`` + ``merges.txt`` for ``words``, load them as a ``CLIPTokenizer`` and
    save it back (adds ``tokenizer.json`` / ``tokenizer_config.json`` with ``model_max_length``)."""
    vocab, merges = clip_vocab_and_merges(words)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False, indent=1) + "\n")
    (out_dir / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{m}\n" for m in merges))
    tokenizer = CLIPTokenizer.from_pretrained(out_dir, model_max_length=max_length)
    split = {w: ids for w in words if len(ids := tokenizer(w, add_special_tokens=False).input_ids) != 1}
    if split:
        raise RuntimeError(f"demo tokenizer splits words into several tokens: {split}")
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def render_demo(demo: DemoData, pixels: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, list[ShapeSpec]]:
    """``n`` demo images (N×pixels×pixels×3 uint8, INTER_AREA from ``demo.image_size``) and their specs."""
    specs = [random_spec(rng, list(demo.colours), list(demo.shapes), list(demo.backgrounds)) for _ in range(n)]
    images = []
    for spec in specs:
        img = render(spec, demo.image_size, demo.colours[spec.colour], demo.backgrounds[spec.background], rng)
        if img.shape[0] != pixels:
            img = cv2.resize(img, (pixels, pixels), interpolation=cv2.INTER_AREA)
        images.append(img)
    return np.stack(images), specs


def to_model_range(images: np.ndarray) -> torch.Tensor:
    """N×H×W×3 uint8 → N×3×H×W float in [-1, 1]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """N×3×H×W float in [-1, 1] → N×H×W×3 uint8."""
    return ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


def demo_batches(demo: DemoData, pixels: int, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """An endless stream of freshly rendered demo batches in [-1, 1]."""
    rng = np.random.default_rng([seed, _TRAIN_STREAM])
    while True:
        yield to_model_range(render_demo(demo, pixels, batch_size, rng)[0])


def probe_accuracy(images: np.ndarray, specs: list[ShapeSpec], demo: DemoData) -> tuple[float, float]:
    """Fraction of ``images`` whose probed colour / shape match their spec."""
    reads = [probe(img, demo.colours, demo.backgrounds) for img in images]
    colour = np.mean([r.colour == s.colour for r, s in zip(reads, specs, strict=True)])
    shape = np.mean([r.shape == s.shape for r, s in zip(reads, specs, strict=True)])
    return float(colour), float(shape)


def build_demo_vae(models: Models, demo: DemoData, pixels: int) -> tuple[AutoencoderKL, dict[str, Any]]:
    """Build, train and calibrate the demo VAE; score it on held-out renders."""
    cfg = models.vae_build
    vae = build_tiny_vae(cfg.block_out_channels, cfg.layers_per_block, cfg.latent_channels, models.seed)
    t0 = time.perf_counter()
    with seeded(models.seed):
        losses = train_vae(
            vae, demo_batches(demo, pixels, cfg.batch_size, models.seed), cfg.train_steps, cfg.lr, cfg.kl_weight
        )
    train_seconds = time.perf_counter() - t0
    calibration, _ = render_demo(
        demo, pixels, VAE_CALIBRATION_IMAGES, np.random.default_rng([models.seed, _CALIBRATION_STREAM])
    )
    vae.register_to_config(scaling_factor=latent_scaling_factor(vae, to_model_range(calibration).split(64)))

    held_out, specs = render_demo(demo, pixels, VAE_EVAL_IMAGES, np.random.default_rng([models.seed, _EVAL_STREAM]))
    recon = to_uint8(reconstruct(vae, to_model_range(held_out)))
    colour_acc, shape_acc = probe_accuracy(recon, specs, demo)
    input_colour_acc, input_shape_acc = probe_accuracy(held_out, specs, demo)
    tail = losses[-max(1, len(losses) // 10) :] if losses else [float("nan")]
    metrics = {
        "vae_train_steps": len(losses),
        "vae_train_seconds": round(train_seconds, 2),
        "vae_loss_first": losses[0] if losses else None,
        "vae_loss_final": float(np.mean(tail)),
        "vae_eval_images": len(specs),
        "vae_recon_mae": float(np.abs(recon.astype(np.float32) - held_out.astype(np.float32)).mean()),
        "vae_probe_colour_acc": colour_acc,
        "vae_probe_shape_acc": shape_acc,
        "vae_probe_colour_acc_input": input_colour_acc,
        "vae_probe_shape_acc_input": input_shape_acc,
    }
    log.info("demo VAE: %s", metrics)
    return vae, metrics


# ------------------------------------------------------------------------------------------ stage


def check_cross_attention(unet_cross_attention_dim: int, text_hidden_size: int) -> None:
    """The UNet's cross-attention reads the text encoder's hidden states: the widths must agree."""
    if unet_cross_attention_dim != text_hidden_size:
        raise ConfigError(
            f"models.unet.cross_attention_dim ({unet_cross_attention_dim}) must equal the text encoder's "
            f"hidden size ({text_hidden_size})"
        )


def _fresh(path: Path) -> Path:
    """An empty ``<path>.tmp`` sibling to write into before :func:`_publish`."""
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, path: Path) -> None:
    """Replace ``path`` with the completed ``tmp`` folder."""
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)


def _build_demo_components(
    models: Models, demo: DemoData, eval_: Eval | None, out: Path, metrics: dict[str, Any]
) -> tuple[CLIPTokenizer, CLIPTextModel, AutoencoderKL]:
    """Demo: a tokenizer over the demo words, a seeded tiny text encoder, a VAE trained on demo renders."""
    tb = models.text_encoder_build
    check_cross_attention(models.unet.cross_attention_dim, tb.hidden_size)
    words = demo_words(demo, eval_)
    tokenizer = write_demo_tokenizer(words, out / TOKENIZER, tb.max_position_embeddings)
    text_encoder = build_tiny_text_encoder(
        vocab_size=len(tokenizer),
        hidden_size=tb.hidden_size,
        intermediate_size=tb.intermediate_size,
        num_hidden_layers=tb.num_hidden_layers,
        num_attention_heads=tb.num_attention_heads,
        max_position_embeddings=tb.max_position_embeddings,
        seed=models.seed,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    metrics["demo_words"] = len(words)
    pixels = models.unet.sample_size * 2 ** (len(models.vae_build.block_out_channels) - 1)
    vae, vae_metrics = build_demo_vae(models, demo, pixels)
    metrics.update(vae_metrics)
    return tokenizer, text_encoder, vae


def _load_pretrained_components(models: Models, out: Path) -> tuple[CLIPTokenizer, CLIPTextModel, AutoencoderKL]:
    """Full scale: the hub (or local) VAE, CLIP text encoder and tokenizer, via ``from_pretrained``."""
    text_encoder = CLIPTextModel.from_pretrained(models.text_encoder)
    check_cross_attention(models.unet.cross_attention_dim, text_encoder.config.hidden_size)
    tokenizer = CLIPTokenizer.from_pretrained(models.text_encoder)
    tokenizer.save_pretrained(out / TOKENIZER)
    return tokenizer, text_encoder, AutoencoderKL.from_pretrained(models.vae)


def save_uncond_embedding(tokenizer: CLIPTokenizer, text_encoder: CLIPTextModel, path: Path) -> torch.Tensor:
    """Encode the empty prompt once (``[1, 77, D]`` fp32, on the CPU) and save it as ``{"uncond": ...}``."""
    from safetensors.torch import save_file

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
    tracking: Tracking | None = None,
) -> dict[str, Any]:
    """Write the frozen components to ``models_dir`` and the seeded UNet to ``scratch_dir``; return metrics.

    ``tracking=None`` skips MLflow (unit tests).
    """
    t0 = time.perf_counter()
    models_dir, scratch_dir = Path(models_dir), Path(scratch_dir)
    out, scratch = _fresh(models_dir), _fresh(scratch_dir)
    metrics: dict[str, Any] = {"source": models.source}

    if models.source == "build":
        tokenizer, text_encoder, vae = _build_demo_components(models, demo, eval_, out, metrics)
    else:
        tokenizer, text_encoder, vae = _load_pretrained_components(models, out)

    vae.save_pretrained(out / VAE, safe_serialization=True)
    text_encoder.save_pretrained(out / TEXT_ENCODER, safe_serialization=True)
    noise_scheduler(models.noise.model_dump()).save_pretrained(out / SCHEDULER)
    save_uncond_embedding(tokenizer, text_encoder, out / UNCOND_EMBEDDING)

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
    if tracking is not None:
        _log_to_mlflow(tracking, models, metrics)
    return metrics


def _log_to_mlflow(tracking: Tracking, models: Models, metrics: dict[str, Any]) -> None:
    from stages.tracking import stage_run

    with stage_run(tracking, parent="models", stage="prepare_models", params={"models": models.model_dump()}) as mlflow:
        mlflow.log_metrics({k: float(v) for k, v in metrics.items() if isinstance(v, int | float)})
        mlflow.log_dict(metrics, "prepare_models.json")


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m stages.prepare_models --params params.yaml``."""
    stage_cli(
        "prepare_models",
        lambda params, _item: run(
            params.models,
            params.demo,
            params.eval,
            params.paths.models,
            Path(params.paths.checkpoints) / SCRATCH,
            tracking=params.tracking,
        ),
        needs_item=False,
        argv=argv,
    )


if __name__ == "__main__":
    main()
