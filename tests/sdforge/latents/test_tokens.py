"""sdforge.latents.inputs.Tokens: a caption longer than the model's length gives the ids of the tokenizer's own
truncation, and the tokenizer is never asked for more than it can use (no "sequence length is longer" warning)."""

from __future__ import annotations

import logging

import pytest

from sdforge.latents.inputs import Tokens
from tests.fixtures.eval_workspace import MAX_TOKENS, write_tokenizer

TOO_LONG = "Token indices sequence length is longer than the specified maximum sequence length"


@pytest.fixture
def tokenizer_log():
    """The messages transformers' tokenizer module logs (its loggers do not propagate to pytest's caplog)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("transformers.tokenization_utils_base")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("words", [MAX_TOKENS - 3, MAX_TOKENS - 2, MAX_TOKENS - 1, 40 * MAX_TOKENS])
def test_long_caption_ids_equal_the_tokenizers_truncation_without_its_warning(words, tmp_path, tokenizer_log):
    """``words`` one-token words + BOS + EOS: MAX_TOKENS - 2 fill the model's length exactly, one more is cut."""
    tokenizer = write_tokenizer(tmp_path / "tokenizer")
    caption = " ".join((["red", "circle", "on", "blue", "background"] * words)[:words])
    captions = ["a red circle", caption, "", caption]
    ids, truncated = Tokens(tokenizer)(captions)
    assert not [m for m in tokenizer_log if TOO_LONG in m]
    expected = tokenizer(captions, padding="max_length", max_length=MAX_TOKENS, truncation=True).input_ids
    assert ids.tolist() == expected
    cut = words + 2 > MAX_TOKENS
    assert truncated == [False, cut, False, cut]
    assert ids[1, min(words + 1, MAX_TOKENS - 1)].item() == tokenizer.eos_token_id


def test_the_caption_stage_counts_every_token_of_a_long_caption_without_the_warning(tmp_path, tokenizer_log):
    from stages.caption_images import token_counter

    write_tokenizer(tmp_path / "tokenizer")
    count = token_counter(tmp_path)
    assert count(" ".join(["red"] * 40)) == 42 and count("a red circle") == 5  # BOS + words + EOS, not cut
    assert not [m for m in tokenizer_log if TOO_LONG in m]
