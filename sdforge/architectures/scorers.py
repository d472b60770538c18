"""Seeded random stand-ins for the two scoring networks (``models.missing_weights: random``, the preflight only).

* **CLIP** (``models.eval_clip``): the real ``CLIPModel`` architecture of a hub id — the text tower from
  ``configs/<id>.json`` (as the text encoder), the vision tower from :data:`VISION_TOWERS` (ViT-L/14: the hub
  ``config.json``'s ``vision_config``) — with CLIP's real tokenizer and the default ``CLIPImageProcessor``
  (224² centre crop, OpenAI's mean/std: the hub's ``preprocessor_config.json``).
* **FID Inception** (``models.fid_inception``): the NVlabs file is a traced TensorFlow graph that cannot be rebuilt
  here without its weights, so :class:`InceptionStandIn` has its *interface* only — ``model(x,
  return_features=True)`` on N×3×H×W floats in 0..255, resized to 299² inside, 2048 pool features — not its
  architecture or cost (~0.3 of its 5.7 GFLOP per image). The preflight's FID figures are meaningless; its
  plumbing (load, resize, features, Fréchet distance) is what runs.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import torch
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

from model.builders import count_parameters, seeded
from sdforge.architectures.clip_tokenizer import write_clip_tokenizer
from sdforge.architectures.frozen import architecture_config
from sdforge.config import ConfigError

log = logging.getLogger(__name__)

VISION_TOWERS = {
    "openai/clip-vit-large-patch14": {
        "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16, "num_hidden_layers": 24,
        "patch_size": 14, "image_size": 224, "projection_dim": 768, "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5,
    },
}  # fmt: skip
"""Vision towers by hub id (the hub ``config.json``'s ``vision_config``)."""
FEATURES = 2048
"""The Inception pool-3 feature width FID is computed on."""


def build_random_clip(hub_id: str, seed: int, out: Path) -> CLIPModel:
    """Save ``hub_id``'s ``CLIPModel`` with seeded random weights and its processor (CLIP's real tokenizer) in
    ``out``; a ConfigError naming ``models.eval_clip`` when its vision tower is not stored here."""
    if hub_id not in VISION_TOWERS:
        known = sorted(VISION_TOWERS)
        raise ConfigError(f"models.eval_clip: no vision tower stored for {hub_id!r} in sdforge/architectures/"
                          f"scorers.py (known: {known}); make the weights available locally")  # fmt: skip
    text = architecture_config(hub_id, "text_encoder")
    config = CLIPConfig(text_config=text, vision_config=VISION_TOWERS[hub_id], projection_dim=text["projection_dim"])
    with seeded(seed):
        model = CLIPModel(config).eval()
    with tempfile.TemporaryDirectory() as tmp:  # the processor saves the tokenizer's files into out itself
        tokenizer = write_clip_tokenizer(Path(tmp), text["max_position_embeddings"])
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(), tokenizer=tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    processor.save_pretrained(out)
    log.info("built %s's CLIP architecture with random weights (seed %d): %d parameters", hub_id, seed,
             count_parameters(model))  # fmt: skip
    return model


class InceptionStandIn(torch.nn.Module):
    """The NVlabs Inception's interface with seeded random weights (see the module docstring)."""

    def __init__(self):
        super().__init__()
        widths = [3, 64, 256, 1024, FEATURES]
        layers: list[torch.nn.Module] = []
        for a, b in zip(widths, widths[1:], strict=False):
            layers += [torch.nn.Conv2d(a, b, 3, stride=2, padding=1), torch.nn.ReLU()]
        self.body = torch.nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, return_features: bool = False) -> torch.Tensor:
        x = torch.nn.functional.interpolate(x / 127.5 - 1, size=[299, 299], mode="bilinear", align_corners=False)
        return self.body(x).mean(dim=(2, 3))


def write_inception_stand_in(path: Path, seed: int) -> None:
    """Save a scripted :class:`InceptionStandIn` (seeded) as a TorchScript file at ``path``."""
    with seeded(seed):
        model = torch.jit.script(InceptionStandIn().eval())
    torch.jit.save(model, str(path))
    log.info("wrote a random stand-in of the FID Inception's interface (seed %d) to %s", seed, path)
