"""Learned word embeddings (textual inversion / pivotal tuning): the input-embedding rows of a few tokenizer words,
trained next to an adapter while the rest of the text encoder stays frozen.

A new word (the demo's "orange") reaches the UNet only through the text encoder's reading of its token row. In a
frozen encoder that row is whatever the encoder's training (or, for the demo's locally built encoder, its random
draw) left there, so how distinct the word's hidden state is from the old words' varies between encoders, and a
LoRA on the UNet alone must separate whatever it gets. Training the row itself lets the phase move the word where
the UNet can tell it apart (Gal et al. 2022; pivotal tuning = this plus a LoRA).

Pure torch, no I/O. While training, :meth:`LearnedWords.attach` puts a forward hook on the encoder's token
embedding that swaps the words' rows for :attr:`LearnedWords.vectors` (the only tensors that get gradients); for
sampling and export :func:`write_rows` copies the vectors into the embedding weight itself — the same values,
so an exported ``text_encoder/`` reproduces what the phase trained and sampled with.
"""

from __future__ import annotations

import torch

LEARNED_WORDS_FILE = "learned_embeds.safetensors"
"""In an adapter phase's ``adapter/`` and ``adapter_ema/``: word → vector, diffusers' textual-inversion layout."""


class LearnedWords(torch.nn.Module):
    """Trainable replacement vectors for the token ids ``token_ids`` of a text encoder's input embedding."""

    def __init__(self, words: list[str], token_ids: list[int], embedding: torch.nn.Embedding):
        super().__init__()
        if len(words) != len(token_ids) or len(set(token_ids)) != len(token_ids):
            raise ValueError(f"one distinct token id per word; got words {words} and ids {token_ids}")
        self.words = list(words)
        self.register_buffer("token_ids", torch.tensor(token_ids, dtype=torch.long), persistent=False)
        with torch.no_grad():
            start = embedding.weight[self.token_ids.to(embedding.weight.device)].float().clone()
        self.vectors = torch.nn.Parameter(start)
        """``[len(words), hidden]``, fp32, starting at the encoder's own rows."""

    def attach(self, embedding: torch.nn.Embedding) -> torch.utils.hooks.RemovableHandle:
        """Hook ``embedding`` so that its output at the words' token ids is :attr:`vectors` (differentiable)."""
        return embedding.register_forward_hook(self._swap_rows)

    def _swap_rows(self, module, args, output: torch.Tensor) -> torch.Tensor:
        ids = args[0]
        hits = ids.unsqueeze(-1) == self.token_ids.to(ids.device)  # [..., n_words]
        if not bool(hits.any()):
            return output
        which = hits.float().argmax(-1)  # the word index where a hit (meaningless elsewhere: masked below)
        replacement = self.vectors.to(output.dtype)[which]
        return torch.where(hits.any(-1, keepdim=True), replacement, output)

    def as_dict(self) -> dict[str, torch.Tensor]:
        """word → its vector (detached, CPU, fp32): the diffusers textual-inversion file's layout."""
        return {w: self.vectors[i].detach().float().cpu().clone() for i, w in enumerate(self.words)}


def single_token_id(tokenizer, word: str) -> int:
    """The one token id ``tokenizer`` reads ``word`` as; a ValueError naming its pieces when it is not one token."""
    ids = tokenizer(word, add_special_tokens=False).input_ids
    if len(ids) != 1 or ids[0] == tokenizer.unk_token_id:
        pieces = tokenizer.convert_ids_to_tokens(ids)
        raise ValueError(f"'{word}' is not one token of this tokenizer (it reads {pieces})")
    return int(ids[0])


@torch.no_grad()
def write_rows(embedding: torch.nn.Embedding, token_ids: list[int], vectors: list[torch.Tensor]) -> None:
    """Copy ``vectors`` into ``embedding``'s weight rows ``token_ids`` (in its dtype and device)."""
    for token_id, vector in zip(token_ids, vectors, strict=True):
        if vector.shape != embedding.weight[token_id].shape:
            raise ValueError(
                f"a learned word vector of shape {tuple(vector.shape)} does not fit this text encoder's "
                f"embedding rows of shape {tuple(embedding.weight[token_id].shape)}"
            )
        embedding.weight[token_id] = vector.to(embedding.weight.dtype)
