"""A vision-language captioner loaded with transformers' ``from_pretrained``, run in batches, its output judged.

``AutoModelForImageTextToText`` covers the families a recaptioning run uses — BLIP, Florence-2, LLaVA-style,
Qwen-VL-style — and ``AutoProcessor`` their image and text preprocessing. A hub id downloads (production); a local
folder (the tests, the demo) loads through the same call. Generation is greedy or beam search as the settings say
(``do_sample`` is refused: a caption must be a function of the image and the settings, or the content cache lies).

Models that continue their prompt (BLIP's conditional captioning) return it at the start of the text: it is cut
off, and only the rest is judged (:mod:`sdforge.captions.quality`). A rejected caption keeps the original one.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from sdforge.captions.quality import judge, words

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Caption:
    """One image's outcome: the caption to train with, the model's text, and why it was rejected (or ``None``)."""

    text: str
    generated: str
    rejected: str | None
    tokens: int


def load_captioner(model: str, revision: str | None = None, dtype: str = "fp32", device: str = "cpu"):
    """``(processor, model)`` from a hub id or a local folder, in eval mode on ``device``."""
    # transformers' auto classes import every model family's config: only the captioning stage needs them
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    processor = AutoProcessor.from_pretrained(model, revision=revision)
    net = AutoModelForImageTextToText.from_pretrained(model, revision=revision, dtype=torch_dtype)
    return processor, net.to(device).eval()


def strip_prompt(text: str, prompt: str) -> str:
    """``text`` without a leading copy of ``prompt`` (compared word by word, case-free)."""
    asked = words(prompt)
    if not asked:
        return text.strip()
    pattern = r"\W*".join(map(re.escape, asked))
    match = re.match(rf"\W*{pattern}\W*", text, flags=re.IGNORECASE)
    return text[match.end() :].strip() if match else text.strip()


def generate(processor, model, images: Sequence[np.ndarray], prompt: str, settings: Mapping) -> list[str]:
    """The model's text for each RGB image (HWC uint8), prompt cut off, in one batch."""
    import torch  # here: a stage that only judges or reads captions (caption_images without recaption) skips it

    if settings.get("do_sample"):
        raise ValueError("generation.do_sample: captions must be deterministic (the content cache keys on settings)")
    inputs = processor(images=list(images), text=[prompt] * len(images), return_tensors="pt", padding=True)
    inputs = inputs.to(model.device)
    with torch.inference_mode():
        out = model.generate(**inputs, **dict(settings))
    texts = processor.batch_decode(out, skip_special_tokens=True)
    return [strip_prompt(t, prompt) for t in texts]


def judge_captions(
    generated: Sequence[str],
    originals: Sequence[str],
    prompt: str,
    count_tokens: Callable[[str], int],
    max_tokens: int = 77,
) -> list[Caption]:
    """Each generation accepted or rejected with its reason; a rejected one keeps its original caption."""
    out = []
    for text, original in zip(generated, originals, strict=True):
        tokens = count_tokens(text)
        reason = judge(text, prompt, tokens, max_tokens)
        out.append(Caption(text=original if reason else text, generated=text, rejected=reason, tokens=tokens))
    return out
