"""Learned word embeddings (textual inversion / pivotal tuning): the input-embedding rows of a few tokenizer words,
trained next to an adapter while the rest of the text encoder stays frozen.

A new word (the demo's "orange") reaches the UNet only through the text encoder's reading of its token row. In a
frozen encoder that row is whatever the encoder's training (or, for the demo's locally built encoder, its random
draw) left there, so how distinct the word's hidden state is from the old words' varies between encoders, and a
LoRA on the UNet alone must separate whatever it gets. Training the row itself lets the phase move the word where
the UNet can tell it apart (Gal et al. 2022; pivotal tuning = this plus a LoRA).

A family with two CLIP encoders (sdxl, mmdit) learns one row per word in each: both read the word, and either
alone can leave it too close to the old colours (docs/SDXL.md "The demo").

Pure torch, no I/O. While training, :meth:`LearnedWords.attach` puts a forward hook on each encoder's token
embedding that swaps the words' rows for that encoder's table (the only tensors that get gradients); for
sampling and export :func:`write_rows` copies the vectors into the embedding weight itself — the same values,
so an exported ``text_encoder/`` reproduces what the phase trained and sampled with.
"""

from __future__ import annotations

import functools

import torch

LEARNED_WORDS_FILE = "learned_embeds.safetensors"
"""In an adapter phase's ``adapter/`` and ``adapter_ema/``: word → vector of the (first) text encoder, diffusers'
textual-inversion layout. A family with more encoders (sdxl, mmdit) adds one file per further encoder
(:func:`learned_words_file`)."""


def learned_words_file(encoder_index: int) -> str:
    """The learned words' file of the family's ``encoder_index``-th text encoder (0-based): ``learned_embeds``
    for the first (``text_encoder/``), ``learned_embeds_2`` for ``text_encoder_2/``, … (``.safetensors``)."""
    return LEARNED_WORDS_FILE if encoder_index == 0 else f"learned_embeds_{encoder_index + 1}.safetensors"


class LearnedWords(torch.nn.Module):
    """Trainable replacement vectors for the token ids ``token_ids`` in each of a family's text encoders' input
    embeddings (``embeddings``, in the family's order; the tokenizers share one vocabulary, so one id per word).

    Each encoder has its own table: :attr:`vectors` for the first (the only one of a one-encoder family),
    ``vectors_2``, ``vectors_3`` for the others (:meth:`tables`)."""

    def __init__(self, words: list[str], token_ids: list[int], embeddings: list[torch.nn.Embedding]):
        super().__init__()
        if len(words) != len(token_ids) or len(set(token_ids)) != len(token_ids):
            raise ValueError(f"one distinct token id per word; got words {words} and ids {token_ids}")
        if not embeddings:
            raise ValueError("learned words need at least one text encoder's embedding")
        self.words = list(words)
        self.register_buffer("token_ids", torch.tensor(token_ids, dtype=torch.long), persistent=False)
        for index, embedding in enumerate(embeddings):
            with torch.no_grad():
                start = embedding.weight[self.token_ids.to(embedding.weight.device)].float().clone()
            self.register_parameter(_table_name(index), torch.nn.Parameter(start))  # fp32, the encoder's own rows

    def tables(self) -> list[torch.nn.Parameter]:
        """Each encoder's ``[len(words), hidden]`` vectors, in the family's encoder order."""
        return [param for _, param in self.named_parameters()]

    def attach(self, embeddings: list[torch.nn.Embedding]) -> list[torch.utils.hooks.RemovableHandle]:
        """Hook each of ``embeddings`` (the family's order) so that its output at the words' token ids is that
        encoder's table (differentiable)."""
        if len(embeddings) != len(self.tables()):
            raise ValueError(f"{len(self.tables())} table(s) of learned words for {len(embeddings)} embedding(s)")
        return [embedding.register_forward_hook(functools.partial(self._swap_rows, table))
                for embedding, table in zip(embeddings, self.tables(), strict=True)]  # fmt: skip

    def _swap_rows(self, table: torch.Tensor, module, args, output: torch.Tensor) -> torch.Tensor:
        ids = args[0]
        hits = ids.unsqueeze(-1) == self.token_ids.to(ids.device)  # [..., n_words]
        if not bool(hits.any()):
            return output
        which = hits.float().argmax(-1)  # the word index where a hit (meaningless elsewhere: masked below)
        replacement = table.to(output.dtype)[which]
        return torch.where(hits.any(-1, keepdim=True), replacement, output)

    def as_dicts(self) -> list[dict[str, torch.Tensor]]:
        """Per encoder, word → its vector (detached, CPU, fp32): the diffusers textual-inversion file's layout."""
        return [{w: table[i].detach().float().cpu().clone() for i, w in enumerate(self.words)}
                for table in self.tables()]  # fmt: skip


def _table_name(encoder_index: int) -> str:
    return "vectors" if encoder_index == 0 else f"vectors_{encoder_index + 1}"


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
