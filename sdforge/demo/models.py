"""The demo's frozen components, built locally: a tokenizer over the demo words, a seeded tiny CLIP text
encoder, and a tiny VAE trained on freshly rendered shapes and scored with :func:`sdforge.demo.shapes.probe`.

Used by the ``prepare_models`` stage when ``models.source: build``.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import AutoencoderKL
from transformers import CLIPTextModel, CLIPTokenizer

from model.builders import build_tiny_text_encoder, build_tiny_vae, clip_vocab_and_merges, seeded
from model.denoisers import DenoiserFamily
from model.text_stack import text_part_dirs
from model.vae_training import latent_scaling_factor, reconstruct, train_vae
from sdforge.config import DemoData, Eval, Models
from sdforge.demo.captioner import train_demo_captioner
from sdforge.demo.shapes import ShapeSpec, probe, render_spec, shown_specs

log = logging.getLogger(__name__)

CAPTION_WORDS = ("a", "on", "background")
VAE_EVAL_IMAGES = 128
VAE_CALIBRATION_IMAGES = 256
# independent RNG streams under models.seed
_TRAIN_STREAM, _EVAL_STREAM, _CALIBRATION_STREAM = 1, 2, 3


def demo_words(demo: DemoData, eval_: Eval | None = None) -> list[str]:
    """Every word of a demo caption and of the eval prompts, in first-seen order, lower-cased."""
    text = [
        ShapeSpec(shape=s, colour=c, background=b).caption()
        for c in demo.palette
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
    """``n`` demo images (N×pixels×pixels×3 uint8, INTER_AREA from ``demo.image_size``) and their specs, drawn
    uniformly from the shown combinations (never a held-out one) of the whole palette: the concept colour too.

    The VAE stands in for a pretrained one that has seen every colour: trained on the five corpus colours
    only, it decoded orange on white as yellow for a third of the shapes, and phase 8's adapter could not
    draw what the frozen VAE cannot (issue 40). The concept is new to the prompt, not to the pixels.

    It has seen every size too: with a ``demo.placed`` source, every other image is drawn at ``placed.half_size``
    (:func:`render_sizes`). Trained on the corpus' large shapes only, it read small shapes' colour right 79-97 % of
    the time and decoded a small green square as purple, and the ControlNet phase drew it so (docs/CONTROL.md)."""
    shown = shown_specs(list(demo.palette), list(demo.shapes), list(demo.backgrounds), demo.held_out)
    specs = [shown[int(i)] for i in rng.integers(0, len(shown), size=n)]
    sizes = render_sizes(demo)
    images = [render_spec(demo, spec, rng, pixels, sizes[i % len(sizes)]) for i, spec in enumerate(specs)]
    return np.stack(images), specs


def render_sizes(demo: DemoData) -> list[tuple[float, float]]:
    """The half-size ranges the VAE's renders take in turn: the corpus', then the ``placed`` source's if any."""
    return [demo.half_size] + ([demo.placed.half_size] if demo.placed is not None else [])


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
    reads = [probe(img, demo.palette, demo.backgrounds) for img in images]
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


def build_demo_text_encoder(
    models: Models, demo: DemoData, eval_: Eval | None, tokenizer_dir: Path
) -> tuple[CLIPTokenizer, CLIPTextModel, int]:
    """A tokenizer over the demo words (saved to ``tokenizer_dir``) and the first tiny text encoder (a
    ``CLIPTextModel``, drawn with ``models.text_encoder_build.seed``; null: ``models.seed``); the number of words."""
    tb = models.text_encoder_build
    words = demo_words(demo, eval_)
    tokenizer = write_demo_tokenizer(words, tokenizer_dir, tb.max_position_embeddings)
    return tokenizer, _tiny_encoder(tokenizer, tb, models.text_encoder_seed, with_projection=False), len(words)


def _tiny_encoder(tokenizer: CLIPTokenizer, tb, seed: int, with_projection: bool) -> CLIPTextModel:
    """A seeded tiny CLIP text encoder over ``tokenizer``'s vocabulary, shaped by the ``TextEncoderBuild`` ``tb``."""
    return build_tiny_text_encoder(
        vocab_size=len(tokenizer), hidden_size=tb.hidden_size, intermediate_size=tb.intermediate_size,
        num_hidden_layers=tb.num_hidden_layers, num_attention_heads=tb.num_attention_heads,
        max_position_embeddings=tb.max_position_embeddings, seed=seed, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, with_projection=with_projection,
    )  # fmt: skip


def build_demo_text_encoders(
    models: Models, demo: DemoData, eval_: Eval | None, out: Path, family: DenoiserFamily
) -> tuple[list[CLIPTokenizer], list[CLIPTextModel], int]:
    """The family's tokenizers over the demo words (one vocabulary, saved as ``out/tokenizer``, ``tokenizer_2``, …)
    and tiny text encoders (the first drawn with ``models.text_encoder_build.seed`` — null: ``models.seed`` —, the
    second with ``text_encoder_2_build``'s); the number of demo words."""
    words = demo_words(demo, eval_)
    tokenizers, encoders = [], []
    builds = models.text_encoder_builds()[: family.text_encoders]
    parts = zip(builds, text_part_dirs(family), family.text_encoder_classes, strict=True)
    for (tb, seed), (_, tokenizer_dir), class_name in parts:
        tokenizer = write_demo_tokenizer(words, out / tokenizer_dir, tb.max_position_embeddings)
        projection = class_name != "CLIPTextModel"
        encoders.append(_tiny_encoder(tokenizer, tb, seed, with_projection=projection))
        tokenizers.append(tokenizer)
    return tokenizers, encoders, len(words)


def build_demo_components(
    models: Models, demo: DemoData, eval_: Eval | None, out: Path, family: DenoiserFamily, metrics: dict[str, Any]
) -> tuple[list[CLIPTokenizer], list[CLIPTextModel], AutoencoderKL]:
    """Demo: the family's tokenizers over the demo words (saved under ``out``), seeded tiny text encoders, a VAE
    trained on demo renders; their figures go into ``metrics``."""
    tokenizers, encoders, metrics["demo_words"] = build_demo_text_encoders(models, demo, eval_, out, family)
    pixels = demo_pixels(models)
    vae, vae_metrics = build_demo_vae(models, demo, pixels)
    metrics.update(vae_metrics)
    return tokenizers, encoders, vae


def demo_pixels(models: Models) -> int:
    """The demo denoiser's image side: its ``sample_size`` × the demo VAE's downsampling."""
    return models.denoiser_spec["sample_size"] * 2 ** (len(models.vae_build.block_out_channels) - 1)


def build_demo_captioner(models: Models, demo: DemoData, out: Path) -> dict[str, Any]:
    """With ``models.captioner_build``: train the demo captioner into ``out`` (:func:`train_demo_captioner`);
    its figures as ``captioner_<name>`` metrics. Without it: nothing, no metrics."""
    build = models.captioner_build
    if build is None:
        return {}
    figures = train_demo_captioner(out, demo, seed=models.seed, **build.model_dump())
    return {f"captioner_{k}": v for k, v in figures.items()}
