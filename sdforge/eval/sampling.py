"""Load a phase checkpoint + frozen models from disk and sample images (eval grid, ``sdforge generate``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from model.denoisers import DenoiserFamily, family_for_config, family_of
from model.learned_words import learned_words_file, single_token_id, write_rows
from model.sampler import (
    decode_to_uint8,
    latent_shape_for,
    sample_latents,
    sampling_scheduler,
    trained_image_side,
    vae_factor,
)
from model.text_stack import TextStack, text_part_dirs
from sdforge.eval.text_lora import fuse_text_lora, load_text_lora
from sdforge.io import InputError, load_failure

log = logging.getLogger(__name__)

LORA_FILE = "pytorch_lora_weights.safetensors"
"""The file name diffusers' ``load_lora_weights(folder)`` / ``load_lora_adapter`` look for: a phase's ``adapter*/``
folders (:mod:`sdforge.training.adapter_files`) and a ``--lora-file`` export hold the adapter under it."""


def pick_device(requested: str = "auto") -> torch.device:
    """CUDA, then Apple MPS, then CPU — or exactly what was requested."""
    if requested != "auto":
        return torch.device(requested)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


@dataclass
class Pipeline:
    """The pieces a sampler needs, loaded with ``from_pretrained`` from local directories."""

    unet: object
    """The denoiser (any family's; the name is the first family's)."""
    vae: object
    text: TextStack
    """The family's tokenizers and text encoders."""
    train_scheduler_config: dict
    checkpoint_hash: str
    objective: str = "diffusion"
    """How the checkpoint was trained (``diffusion`` or ``flow_matching``): picks the sampler's scheduler."""
    flow_shift: float = 1.0
    distill: dict | None = None
    """A consistency-distilled phase's ``Distill`` options (state.json ``distill``): LCM / few-step sampling."""
    controlnet: dict | None = None
    """A ControlNet phase's ``ControlNet`` options (state.json ``controlnet``): ``unet`` is then the denoiser under
    its ControlNet, and every image is drawn under a conditioning image (:func:`generate`'s ``control_images``)."""

    @property
    def denoiser(self):
        """The denoiser itself (a ControlNet phase's base, without its ControlNet)."""
        return self.unet.denoiser if self.controlnet is not None else self.unet

    @property
    def family(self) -> DenoiserFamily:
        return self.text.family

    @property
    def text_encoder(self):
        """The first text encoder (learned words are written into it)."""
        return self.text.text_encoder

    @property
    def tokenizer(self):
        return self.text.tokenizer

    def scheduler(self):
        """The scheduler ``generate`` samples with, and an export writes (:func:`model.sampler.sampling_scheduler`)."""
        return sampling_scheduler(self.train_scheduler_config, self.objective, self.flow_shift, self.distill,
                                  flow_euler=self.family.flow_euler)  # fmt: skip


def few_step_settings(pipe: Pipeline) -> tuple[int, float] | None:
    """``(steps, guidance_scale)`` a distilled phase samples with by default — its ``distill.sampling_steps`` and
    1.0 (the guidance is in the teacher's solve) — or None for an ordinary phase."""
    if not pipe.distill:
        return None
    return int(pipe.distill["sampling_steps"]), 1.0


def max_steps(pipe: Pipeline) -> int | None:
    """The most steps ``pipe`` samples with: a distilled diffusion phase's LCM steps are a subset of its solver
    grid (``distill.num_ddim_timesteps``; diffusers refuses more); None: no limit."""
    if pipe.distill and pipe.objective == "diffusion":
        return int(pipe.distill["num_ddim_timesteps"])
    return None


def trained_side(pipe: Pipeline) -> int:
    """The image side in px the UNet was trained at: its sample size × the VAE's downsampling (``sdforge generate``
    bounds ``--width``/``--height`` by it, :data:`sdforge.config.arguments.MAX_SIZE_FACTOR`)."""
    return trained_image_side(pipe.unet, pipe.vae)


def checkpoint_hash(*weights_dirs: Path) -> str:
    """Short sha256 of a checkpoint's weight files (folders: their safetensors; stamped into generated PNGs)."""
    h = hashlib.sha256()
    for weights_dir in weights_dirs:
        files = [weights_dir] if weights_dir.is_file() else sorted(weights_dir.rglob("*.safetensors"))
        for f in files:
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def checkpoint_state(checkpoint_dir: Path) -> dict:
    """The phase checkpoint's ``state.json`` (objective, flow shift, adapter, distill); ``{}`` when absent
    (scratch, older checkpoints: diffusion, no adapter)."""
    path = checkpoint_dir / "state.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise InputError(f"{path}: not JSON ({err}); re-run the train stage that wrote {checkpoint_dir}") from None


def unmerged_adapter(checkpoint_dir: Path, use_ema: bool) -> Path | None:
    """The LoRA folder to apply on top of ``unet_ema/`` (``unet/``) — only for an ``adapter.merge: false`` phase."""
    adapter = checkpoint_state(checkpoint_dir).get("adapter")
    if not adapter or adapter.get("merge", True):
        return None
    folder = checkpoint_dir / ("adapter_ema" if use_ema else "adapter")
    if not folder.is_dir():
        raise InputError(f"{folder}: missing, but state.json says the adapter is not merged into the UNet")
    return folder


def saved_family(folder: Path) -> DenoiserFamily:
    """The denoiser family of a saved model folder, from its ``config.json`` (``_class_name`` and keys); an
    InputError naming the folder when it is none of the families'."""
    try:
        config = json.loads((folder / "config.json").read_text())
        return family_for_config(config.get("_class_name", ""), config)
    except (OSError, ValueError, AttributeError) as err:
        raise InputError(f"{folder}: not a denoiser this project trains ({load_failure(err)})") from None


def load_pipeline(
    models_dir: Path, checkpoint_dir: Path, use_ema: bool = True, device: str = "auto", fuse_adapter: bool = False
) -> Pipeline:
    """UNet from ``checkpoint_dir/unet_ema`` (or ``unet``), frozen VAE/text encoder/tokenizer from ``models_dir``.

    An unmerged adapter (``adapter.merge: false``) is applied unfused, as ``load_lora_weights`` applies it; with
    ``fuse_adapter`` it is fused into the UNet's weights and its LoRA layers dropped — the form ``sdforge export``
    writes by default (fused weights round differently: up to a pixel level apart).

    Weights are read from safetensors only (a pickled ``.bin`` is refused, never unpickled); a folder that
    does not load is an :class:`InputError` of one line naming it and what to do.
    """
    weights = checkpoint_dir / ("unet_ema" if use_ema else "unet")
    if not (weights / "config.json").is_file():
        raise InputError(f"{weights}: no UNet weights there (is {checkpoint_dir} a phase checkpoint?)")
    denoiser_family = saved_family(weights)
    text_dirs = [d for pair in text_part_dirs(denoiser_family) for d in pair]
    for sub in ("vae", *text_dirs, "scheduler"):
        if not (models_dir / sub).is_dir():
            raise InputError(f"{models_dir / sub}: missing (run `dvc repro prepare_models`)")
    # lazy: diffusers + transformers cost 4-6 s to import; the eval grid of a phase it skips never loads a model
    from diffusers import AutoencoderKL, DDPMScheduler

    dev = pick_device(device)
    state = checkpoint_state(checkpoint_dir)
    unet, adapter = _load_denoiser(checkpoint_dir, weights, use_ema, fuse_adapter, denoiser_family)
    text = _load_text(models_dir, denoiser_family, dev, adapter, fuse_adapter)
    words = apply_phase_words(text, checkpoint_dir / ("adapter_ema" if use_ema else "adapter"))
    return Pipeline(
        unet=unet.to(dev).eval(),
        vae=_load(AutoencoderKL, models_dir / "vae", REPREPARE).to(dev).eval(),
        text=text,
        train_scheduler_config=dict(DDPMScheduler.load_config(models_dir / "scheduler")),
        checkpoint_hash=checkpoint_hash(weights, *(p for p in (adapter, *words) if p is not None and p.exists())),
        objective=state.get("objective", "diffusion"),
        flow_shift=float(state.get("flow_shift", 1.0)),
        distill=state.get("distill"),
        controlnet=state.get("controlnet"),
    )


REPREPARE = "re-run `dvc repro prepare_models`"


def _load_text(models_dir: Path, denoiser_family: DenoiserFamily, dev, adapter: Path | None,
               fuse_adapter: bool) -> TextStack:  # fmt: skip
    """The family's tokenizers and text encoders from ``models_dir`` on ``dev``, with an unmerged adapter's text
    encoder LoRA (``adapter.text_encoders``) applied from ``adapter``'s LoRA file (fused if asked)."""
    # lazy: transformers costs 2-3 s to import (load_pipeline)
    import transformers
    from transformers import CLIPTokenizer

    encoders, tokenizers = {}, []
    parts = zip(denoiser_family.text_encoder_classes, text_part_dirs(denoiser_family), strict=True)
    for class_name, (encoder_dir, tokenizer_dir) in parts:
        encoders[encoder_dir] = _load(getattr(transformers, class_name), models_dir / encoder_dir, REPREPARE)
        tokenizers.append(_load(CLIPTokenizer, models_dir / tokenizer_dir, REPREPARE, weights=False))
    for name in [] if adapter is None else load_text_lora(encoders, adapter, LORA_FILE):
        if fuse_adapter:
            fuse_text_lora(encoders[name])
    return TextStack(denoiser_family, tokenizers, [e.to(dev).eval() for e in encoders.values()])


def _load_denoiser(checkpoint_dir: Path, weights: Path, use_ema: bool, fuse_adapter: bool,
                   denoiser_family: DenoiserFamily) -> tuple:  # fmt: skip
    """The phase's denoiser from ``weights``, with its unmerged adapter applied (fused if asked) or under its
    ControlNet (``controlnet_ema/``, ``controlnet/``); ``(model, the adapter folder or None)``."""
    retrain = f"re-run the train stage that wrote {checkpoint_dir}, or pass another checkpoint"
    unet = _load(denoiser_family.model_class(), weights, retrain)
    adapter = unmerged_adapter(checkpoint_dir, use_ema)
    if adapter is not None:
        load_lora(unet, adapter)
        if fuse_adapter:
            fuse_lora(unet)
    settings = checkpoint_state(checkpoint_dir).get("controlnet")
    if settings is not None:
        folder = checkpoint_dir / ("controlnet_ema" if use_ema else "controlnet")
        if not any(folder.glob("*.safetensors")):
            raise InputError(f"{folder}: no ControlNet weights there, but state.json says the phase trained one; "
                             f"{retrain}")  # fmt: skip
        try:
            unet = denoiser_family.load_controlled(unet, folder, float(settings["conditioning_scale"]))
        except Exception as err:  # noqa: BLE001 - a folder that does not load is the folder's fault: one line
            raise InputError(f"{folder}: cannot be loaded ({load_failure(err, with_type=True)}); {retrain}") from None
    return unet, adapter


def apply_phase_words(text: TextStack, adapter_dir: Path) -> list[Path]:
    """Write an adapter phase's learned words from ``adapter_dir`` into each of ``text``'s encoders that has a file
    (:func:`model.learned_words.learned_words_file`); the files applied."""
    applied = []
    for index, (encoder, tokenizer) in enumerate(zip(text.encoders, text.tokenizers, strict=True)):
        path = adapter_dir / learned_words_file(index)
        if path.is_file():
            apply_learned_words(encoder, tokenizer, path)
            applied.append(path)
    return applied


def apply_learned_words(text_encoder, tokenizer, path: Path) -> None:
    """Write an adapter phase's learned words (``path``: word → vector) into ``text_encoder``'s embedding rows; an
    InputError naming the file when a word is not one token of ``tokenizer`` or a vector does not fit."""
    try:
        vectors = load_file(path)
    except Exception as err:  # noqa: BLE001 - an unreadable file is the file's fault: one line
        raise InputError(f"{path}: cannot read the learned words ({load_failure(err, with_type=True)})") from None
    try:
        ids = [single_token_id(tokenizer, word) for word in vectors]
        write_rows(text_encoder.get_input_embeddings(), ids, list(vectors.values()))
    except ValueError as err:  # another tokenizer or text encoder than the phase trained with
        raise InputError(f"{path}: {err} (was the phase trained with other models?)") from None
    log.info("%s: learned words %s written into the text encoder", path, sorted(vectors))


def load_lora(unet, folder: Path) -> None:
    """Apply the diffusers LoRA file in ``folder`` to ``unet`` the way ``load_lora_weights`` does (unfused)."""
    try:
        unet.load_lora_adapter(str(folder), prefix=family_of(unet).lora_prefix, weight_name=LORA_FILE)
    except Exception as err:  # noqa: BLE001 - a file that does not apply is the folder's fault: one line
        failure = load_failure(err, with_type=True)
        raise InputError(f"{folder}: the LoRA does not apply to this UNet ({failure})") from None


def fuse_lora(unet) -> None:
    """Fuse the LoRA applied to ``unet`` into its weights and drop the LoRA layers (a plain UNet again)."""
    unet.fuse_lora()
    unet.unload_lora()


def _load(cls, folder: Path, remedy: str, weights: bool = True):
    """``cls.from_pretrained(folder)`` (safetensors only when ``weights``); an InputError naming the folder if not."""
    if weights and not any(folder.glob("*.safetensors")):
        found = sorted(p.name for p in folder.iterdir())
        raise InputError(
            f"{folder}: no .safetensors weights (found {found or 'nothing'}; other formats are never loaded); {remedy}"
        )
    try:
        return cls.from_pretrained(folder, use_safetensors=True) if weights else cls.from_pretrained(folder)
    except Exception as err:  # noqa: BLE001 - any failure to load is the folder's: report it in one line
        raise InputError(f"{folder}: cannot be loaded ({load_failure(err, with_type=True)}); {remedy}") from None


def generate(
    pipe: Pipeline,
    prompts: list[str],
    *,
    negative_prompt: str = "",
    steps: int,
    guidance_scale: float,
    seeds: list[int],
    batch_size: int = 8,
    width: int | None = None,
    height: int | None = None,
    control_images: list[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """RGB uint8 images, one per prompt; image ``i`` depends only on ``prompts[i]`` and ``seeds[i]`` (and, for a
    ControlNet phase, ``control_images[i]``: RGB uint8 ``[H, W, 3]`` at the image size, fed as ``pixels / 255``, as
    ``StableDiffusionControlNetPipeline`` does). ``width`` and ``height`` (default: the UNet's sample size) may
    differ: any multiple of ``pixel_multiple`` (SD: 64). ``guidance_scale <= 1``: no CFG, the negative prompt unused
    (as in ``StableDiffusionPipeline``)."""
    scheduler = pipe.scheduler()
    shape = latent_shape_for(pipe.unet, pipe.vae, width=width, height=height)
    image_px = (shape[1] * vae_factor(pipe.vae), shape[2] * vae_factor(pipe.vae))
    controls = control_tensors(pipe, control_images, len(prompts), shape)
    images: list[np.ndarray] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        cond = pipe.text.encode_prompts(chunk)
        # the negative prompt once per image, in one batch, as the pipelines encode it: a batch of 1 rounds the
        # encoder's matmuls differently (~1e-6 in SDXL's latents)
        uncond = pipe.text.encode_prompts([negative_prompt] * len(chunk)) if guidance_scale > 1 else None
        gens = [torch.Generator().manual_seed(s) for s in seeds[start : start + batch_size]]
        control = contextlib.nullcontext()
        if controls is not None:
            control = pipe.unet.conditioned(controls[start : start + batch_size].to(cond.device))
        with control:
            latents = sample_latents(pipe.unet, scheduler, cond, uncond, steps=steps, guidance_scale=guidance_scale,
                                     latent_shape=shape, generators=gens, image_px=image_px)  # fmt: skip
        images.extend(decode_to_uint8(pipe.vae, latents).numpy())
    return images


def control_tensors(pipe: Pipeline, images: list[np.ndarray] | None, count: int, latent_shape) -> torch.Tensor | None:
    """``images`` as the ControlNet reads them (``float32 [N, 3, H, W]``, ``pixels / 255``); None for a phase without
    a ControlNet. A ValueError when a ControlNet phase gets none, another phase gets some, or a count or size is
    not the images'."""
    if pipe.controlnet is None:
        if images is not None:
            raise ValueError("conditioning images given, but this checkpoint has no ControlNet")
        return None
    if images is None or len(images) != count:
        raise ValueError(f"this checkpoint is a ControlNet phase: it needs one conditioning image per image "
                         f"({count}); got {0 if images is None else len(images)}")  # fmt: skip
    side = vae_factor(pipe.vae)
    want = (latent_shape[-2] * side, latent_shape[-1] * side, 3)
    bad = [i for i, image in enumerate(images) if image.shape != want or image.dtype != np.uint8]
    if bad:
        raise ValueError(f"conditioning image(s) {bad} are not RGB uint8 of the image size {want[1]}x{want[0]}")
    stacked = torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2)
    return stacked.float() / 255.0

