"""The frozen text side of a denoiser family: its tokenizers and text encoders, and the packed conditioning tensor
they give (:mod:`model.denoisers.base`). Pure torch + transformers objects handed in; no I/O.

Token ids are stored once per sample, from the first tokenizer (``encode_latents``). A family with more encoders
(``mmdit``: CLIP-L and bigG) needs their tokenizers to share the first's vocabulary (CLIP's BPE; SD3's two do), so
each encoder's ids are the stored ones with that tokenizer's own padding after the first end-of-text token
(SD3's second tokenizer pads with ``!``, the first with end-of-text): what the tokenizer itself would give.
"""

from __future__ import annotations

import torch

from model.denoisers import CondPart, DenoiserFamily


class TextStack:
    """A family's tokenizers + frozen text encoders; ``encode_*`` return its packed conditioning ``[B, L, D]``."""

    def __init__(self, family: DenoiserFamily, tokenizers: list, encoders: list):
        if len(tokenizers) != family.text_encoders or len(encoders) != family.text_encoders:
            raise ValueError(f"the {family.name} family takes {family.text_encoders} text encoder(s) and tokenizer(s); "
                             f"got {len(encoders)} and {len(tokenizers)}")  # fmt: skip
        vocab = tokenizers[0].get_vocab()
        for i, tokenizer in enumerate(tokenizers[1:], start=2):
            if tokenizer.get_vocab() != vocab:
                raise ValueError(f"tokenizer_{i} does not share the first tokenizer's vocabulary; the token ids are "
                                 "stored once, from the first, so every tokenizer must read them alike")  # fmt: skip
        self.family, self.tokenizers, self.encoders = family, tokenizers, encoders
        self.max_length = int(tokenizers[0].model_max_length)
        self.eos_id = int(tokenizers[0].eos_token_id)

    @property
    def tokenizer(self):
        """The first tokenizer (the one whose ids are stored)."""
        return self.tokenizers[0]

    @property
    def text_encoder(self):
        """The first text encoder (learned words hook into its embedding rows)."""
        return self.encoders[0]

    def tokenize(self, prompts: list[str]) -> torch.Tensor:
        """The first tokenizer's ids ``[B, L]``, padded/truncated to its length (as the pipelines tokenize)."""
        return self.tokenizers[0](prompts, padding="max_length", max_length=self.max_length, truncation=True,
                                  return_tensors="pt").input_ids  # fmt: skip

    def ids_per_encoder(self, ids: torch.Tensor) -> list[torch.Tensor]:
        """Each encoder's ids from the first tokenizer's: the same tokens, its own padding after the first EOS."""
        after_eos = (ids == self.eos_id).long().cumsum(dim=1) - (ids == self.eos_id).long() > 0
        out = [ids]
        for tokenizer in self.tokenizers[1:]:
            pad = tokenizer.pad_token_id
            out.append(ids if pad is None or pad == self.eos_id else ids.masked_fill(after_eos, int(pad)))
        return out

    def encode_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Packed conditioning of token ids ``[B, L]`` (on the encoders' device), in the encoders' dtype."""
        device = self.encoders[0].device
        return self.family.encode_text(self.encoders, [i.to(device) for i in self.ids_per_encoder(ids)])

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        """Packed conditioning of ``prompts``."""
        return self.encode_ids(self.tokenize(prompts))

    def parts(self) -> list[CondPart]:
        """The regions of the packed tensor ``phases.<p>.caption_dropout`` may drop one by one."""
        widths = [int(e.config.hidden_size) for e in self.encoders]
        pooled = [int(getattr(e.config, "projection_dim", e.config.hidden_size)) for e in self.encoders]
        return self.family.cond_parts(widths, pooled, self.max_length)


def text_part_dirs(family: DenoiserFamily) -> list[tuple[str, str]]:
    """``(text_encoder, tokenizer)`` folder names under ``paths.models`` of each of the family's encoders:
    ``text_encoder``/``tokenizer``, then ``text_encoder_2``/``tokenizer_2``, … (diffusers' pipeline names)."""
    return [(f"text_encoder{s}", f"tokenizer{s}") for s in ["", *(f"_{i}" for i in range(2, family.text_encoders + 1))]]
