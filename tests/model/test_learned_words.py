"""Learned words: the training hook and the written rows give the same text embeddings; only the words' vectors
get gradients; prompts without the words are untouched."""

import pytest
import torch

from model.builders import build_tiny_text_encoder
from model.learned_words import LearnedWords, learned_words_file, write_rows

WORD, OTHER = 7, 9  # token ids standing for the learned word and an old word


def _encoder(seed: int = 0):
    return build_tiny_text_encoder(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=8, seed=seed, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip


def _learned(encoder) -> LearnedWords:
    words = LearnedWords(["orange"], [WORD], [encoder.get_input_embeddings()])
    with torch.no_grad():
        words.vectors.add_(torch.randn(words.vectors.shape, generator=torch.Generator().manual_seed(1)))
    return words


def test_the_hook_and_the_written_rows_give_identical_embeddings():
    ids = torch.tensor([[0, 3, WORD, 5, 1, 1, 1, 1], [0, 3, OTHER, 5, 1, 1, 1, 1]])
    hooked, plain, written = _encoder(), _encoder(), _encoder()
    words = _learned(hooked)
    [handle] = words.attach([hooked.get_input_embeddings()])
    write_rows(written.get_input_embeddings(), [WORD], list(words.as_dicts()[0].values()))
    with torch.no_grad():
        a, b, c = (m(ids).last_hidden_state for m in (hooked, written, plain))
    assert torch.equal(a, b)  # training's hook == what eval, generate and export sample with
    assert not torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])  # only the prompt with the word moves
    handle.remove()
    with torch.no_grad():
        assert torch.equal(hooked(ids).last_hidden_state, c)  # the hook removed: the encoder is its own again


def test_only_the_words_vectors_get_gradients():
    encoder = _encoder()
    words = LearnedWords(["orange"], [WORD], [encoder.get_input_embeddings()])
    start = encoder.get_input_embeddings().weight[WORD].clone()
    assert torch.equal(words.vectors[0], start)  # starts at the encoder's own row
    words.attach([encoder.get_input_embeddings()])
    out = encoder(torch.tensor([[0, WORD, 4, 1]])).last_hidden_state
    out.square().sum().backward()
    assert words.vectors.grad is not None and float(words.vectors.grad.abs().sum()) > 0
    assert all(p.grad is None for p in encoder.parameters())  # the encoder itself stays frozen


def test_a_vector_of_another_width_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        write_rows(_encoder().get_input_embeddings(), [WORD], [torch.zeros(5)])
    with pytest.raises(ValueError, match="one distinct token id per word"):
        LearnedWords(["a", "b"], [WORD, WORD], [_encoder().get_input_embeddings()])
    with pytest.raises(ValueError, match="1 table\\(s\\) of learned words for 2 embedding"):
        LearnedWords(["a"], [WORD], [_encoder().get_input_embeddings()]).attach([_encoder().get_input_embeddings()] * 2)


def test_two_encoders_each_get_their_own_trained_row():
    """sdxl / mmdit: one table per encoder, each starting at its own encoder's row, each hooked into its encoder,
    each written to its own file (``learned_embeds.safetensors``, ``learned_embeds_2.safetensors``)."""
    first, second = _encoder(seed=0), _encoder(seed=1)
    embeddings = [first.get_input_embeddings(), second.get_input_embeddings()]
    words = LearnedWords(["orange"], [WORD], embeddings)
    assert [n for n, _ in words.named_parameters()] == ["vectors", "vectors_2"]
    assert torch.equal(words.vectors_2[0], second.get_input_embeddings().weight[WORD])
    words.attach(embeddings)
    ids = torch.tensor([[0, WORD, 4, 1]])
    (first(ids).last_hidden_state.square().sum() + second(ids).last_hidden_state.square().sum()).backward()
    assert words.vectors.grad is not None and words.vectors_2.grad is not None
    assert not torch.allclose(words.vectors.grad, words.vectors_2.grad)  # each encoder trains its own row
    assert [learned_words_file(i) for i in range(2)] == ["learned_embeds.safetensors", "learned_embeds_2.safetensors"]
    assert [list(d) for d in words.as_dicts()] == [["orange"], ["orange"]]
