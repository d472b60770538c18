"""The frozen parts a phase trains with, read from ``paths.models``: the noise scheduler, the family's tokenizers and
CLIP text encoders (eval mode, no gradients: :class:`model.text_stack.TextStack`) and the empty prompt's embedding
(for CFG dropout)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import transformers
from diffusers import DDPMScheduler
from safetensors.torch import load_file
from transformers import CLIPTokenizer

from model.adapters import add_text_adapter
from model.denoisers import DenoiserFamily
from model.diffusion import to_device
from model.learned_words import LearnedWords, single_token_id
from model.text_stack import TextStack, text_part_dirs
from sdforge.config import Adapter, Train
from sdforge.io import InputError

log = logging.getLogger(__name__)

UNCOND_FILE = "uncond_embedding.safetensors"
"""The empty prompt's embedding, written once by ``prepare_models``."""


class Conditioning:
    """Noise scheduler, the family's tokenizers and frozen text encoders, and the empty-prompt embedding on
    ``device``."""

    def __init__(self, models: Path, device: torch.device, text_encoder_dtype: str, family: DenoiserFamily):
        self.scheduler = DDPMScheduler.from_pretrained(models / "scheduler")
        # on the device once: add_noise / get_velocity / compute_snr then index it there instead of copying it up
        # (a synchronising copy) every micro-batch; the same values
        self.scheduler.alphas_cumprod = self.scheduler.alphas_cumprod.to(device)
        self.text = load_text_stack(models, family, device, text_encoder_dtype)
        self.tokenizer, self.text_encoder = self.text.tokenizer, self.text.text_encoder
        self._uncond = _uncond_embedding(models, self.text, device)
        self.device = device
        self.words: LearnedWords | None = None
        """The phase's learned words (``adapter.words``), hooked into the encoder; None: it is frozen whole."""
        self.adapted: dict[str, torch.nn.Module] = {}
        """The text encoders that train a LoRA (``adapter.text_encoders``), by folder name; empty: none."""
        self._empty_ids = self.text.tokenize([""]).to(device)

    @property
    def uncond(self) -> torch.Tensor:
        """The empty prompt's embedding ``[1, L, D]``: prepare_models' one, or encoded now through the adapted text
        encoders (differentiable) when a LoRA trains on them."""
        return self.encode(self._empty_ids) if self.adapted else self._uncond

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Within the block the adapted text encoders are in eval mode (no LoRA dropout), as for sampling."""
        for encoder in self.adapted.values():
            encoder.eval()
        try:
            yield
        finally:
            for encoder in self.adapted.values():
                encoder.train()

    def adapt_text_encoders(self, spec: Adapter | None) -> dict[str, torch.nn.Module]:
        """Add the phase's LoRA to the text encoders ``adapter.text_encoders`` names (:func:`add_text_adapter`);
        those encoders by folder name (``text_encoder``, ``text_encoder_2``), in train mode."""
        names = [encoder_dir for encoder_dir, _ in text_part_dirs(self.text.family)]
        for name in [] if spec is None else spec.text_encoders:
            encoder = self.text.encoders[names.index(name)]
            trainable = add_text_adapter(encoder, spec.type, spec.rank, spec.alpha, spec.dropout)
            self.adapted[name] = encoder.train()
            log.info("%s LoRA rank %d on %s's attention: %d trainable weights", spec.type, spec.rank, name,
                     sum(p.numel() for _, p in trainable))  # fmt: skip
        return self.adapted

    def learn_words(self, words: list[str], where: str) -> LearnedWords | None:
        """Make the input-embedding rows of ``words`` trainable in every text encoder of the family
        (:class:`model.learned_words.LearnedWords`, hooked into each); None for no words. An InputError naming
        ``where`` for a word that is not one token."""
        if not words:
            return None
        token_ids = [word_token_id(self.tokenizer, word, where) for word in words]
        embeddings = [encoder.get_input_embeddings() for encoder in self.text.encoders]
        self.words = LearnedWords(words, token_ids, embeddings).to(self.device)
        self.words.attach(embeddings)
        log.info("%s: learning the embedding rows of %s (token ids %s) in %d text encoder(s)", where, words,
                 token_ids, len(embeddings))  # fmt: skip
        return self.words

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, 77]`` → text embeddings ``[B, 77, D]`` in fp32 (bf16 encoder on CUDA; no-op in fp32);
        differentiable only through learned words' rows and the text encoders' LoRA."""
        trains = self.words is not None or bool(self.adapted)
        with torch.set_grad_enabled(trains and torch.is_grad_enabled()):
            return self.text.encode_ids(to_device(input_ids, self.device)).float()

    def caption_parts(self, rates: dict[str, float]) -> list:
        """``phases.<p>.caption_dropout`` as ``(part, rate)`` pairs in the family's part order."""
        return [(part, rates[part.name]) for part in self.text.parts() if rates.get(part.name)]


def word_token_id(tokenizer, word: str, where: str) -> int:
    """The one token id ``tokenizer`` reads ``word`` as; an InputError naming ``where`` when it is not one token."""
    try:
        return single_token_id(tokenizer, word)
    except ValueError as err:
        raise InputError(
            f"{where}: {err}; learned words must be single tokens the tokenizer already has — pick another word"
        ) from None


def load_text_stack(models: Path, family: DenoiserFamily, device: torch.device, dtype_name: str = "fp32") -> TextStack:
    """The family's tokenizers and text encoders from ``models`` (on ``device``, eval mode, no gradients; bf16 only
    on CUDA when ``dtype_name`` asks)."""
    dtype = torch.bfloat16 if device.type == "cuda" and dtype_name == "bf16" else torch.float32
    tokenizers, encoders = [], []
    parts = zip(family.text_encoder_classes, text_part_dirs(family), strict=True)
    for class_name, (encoder_dir, tokenizer_dir) in parts:
        tokenizers.append(CLIPTokenizer.from_pretrained(models / tokenizer_dir))
        encoder = getattr(transformers, class_name).from_pretrained(models / encoder_dir)
        encoder.to(device, dtype=dtype).eval()
        encoder.requires_grad_(False)
        encoders.append(encoder)
    return TextStack(family, tokenizers, encoders)


def _uncond_embedding(models: Path, text: TextStack, device: torch.device) -> torch.Tensor:
    """The empty prompt's embedding: the one prepare_models wrote, else encoded now."""
    uncond_file = models / UNCOND_FILE
    if uncond_file.is_file():
        return load_file(uncond_file)["uncond"].to(device)
    return text.encode_prompts([""]).float()


def set_kernel_policy(cfg: Train, device: torch.device) -> None:
    """TF32 on CUDA as ``train.tf32`` says; deterministic kernels if ``train.deterministic``."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    if cfg.deterministic:
        use_deterministic_kernels()


def use_deterministic_kernels() -> None:
    """Deterministic kernels where torch has them (``train.deterministic``); ops without one only warn."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS makes its first handle
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    log.info(
        "train.deterministic: deterministic algorithms on (CUBLAS_WORKSPACE_CONFIG=%s)",
        os.environ["CUBLAS_WORKSPACE_CONFIG"],
    )
