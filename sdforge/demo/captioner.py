"""A BLIP captioner built locally from the real architecture's classes (no download): the tests', the
benchmark's and, later, the demo's captioner (issue 26). Random weights until trained."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import BertTokenizer, BlipConfig, BlipForConditionalGeneration, BlipImageProcessor, BlipProcessor

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]"]


def build_blip(
    out: Path, words: list[str], width: int = 32, layers: int = 1, image_size: int = 32, seed: int = 0
) -> Path:
    """``BlipForConditionalGeneration`` with vision and text towers of ``width`` and ``layers``, its processor (a BERT
    word-piece tokenizer over ``words``, BLIP's image processor at ``image_size``), saved to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    vocab = out / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + list(words)) + "\n")
    tokenizer = BertTokenizer(str(vocab), bos_token="[DEC]")
    heads = max(1, width // 16)
    vision = {"hidden_size": width, "intermediate_size": 2 * width, "num_hidden_layers": layers,
              "num_attention_heads": heads, "image_size": image_size, "patch_size": 8,
              "projection_dim": width}  # fmt: skip
    text = {"vocab_size": len(SPECIAL) + len(words), "hidden_size": width, "intermediate_size": 2 * width,
            "num_hidden_layers": layers, "num_attention_heads": heads, "max_position_embeddings": 64,
            "encoder_hidden_size": width, "pad_token_id": 0, "bos_token_id": SPECIAL.index("[DEC]"),
            "sep_token_id": SPECIAL.index("[SEP]"), "eos_token_id": SPECIAL.index("[SEP]")}  # fmt: skip
    torch.manual_seed(seed)
    model = BlipForConditionalGeneration(BlipConfig(vision_config=vision, text_config=text, projection_dim=width))
    processor = BlipProcessor(
        image_processor=BlipImageProcessor(size={"height": image_size, "width": image_size}), tokenizer=tokenizer
    )
    model.save_pretrained(out)
    processor.save_pretrained(out)
    vocab.unlink()
    return out
