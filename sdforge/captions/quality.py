"""Degenerate generations: named, so the stage keeps the original caption for them and counts why.

A synthetic caption is rejected when it is empty, repeats itself (a word or a 3-word phrase over and over, the
classic failure of greedy decoding), echoes the prompt instead of describing the image, or runs over the length cap
(CLIP's 77 tokens by default: the text encoder would truncate it). :func:`judge` returns the reason, or ``None``.
"""

from __future__ import annotations

import re
from collections import Counter

EMPTY, REPETITION, PROMPT_ECHO, TOO_LONG = "empty", "repetition", "prompt_echo", "too_long"
REASONS = (EMPTY, REPETITION, PROMPT_ECHO, TOO_LONG)
MAX_NGRAM_REPEATS = 3
"""A 3-word phrase may occur this many times at most (``a red circle ... a red circle ... a red circle`` is one
too many)."""
MAX_WORD_SHARE = 0.5
"""In a caption of 6 words or more, no word (but stop words) may be more than this share of the words."""
STOP_WORDS = frozenset({"a", "an", "the", "of", "on", "in", "and", "with", "to", "is", "at"})


def words(text: str) -> list[str]:
    """Lower-case words of ``text`` (letters, digits, apostrophes)."""
    return re.findall(r"[a-z0-9']+", text.lower())


def is_repetitive(text: str) -> bool:
    """True if a 3-word phrase repeats more than :data:`MAX_NGRAM_REPEATS` times or one content word dominates."""
    tokens = words(text)
    trigrams = Counter(zip(tokens, tokens[1:], tokens[2:], strict=False))
    if trigrams and max(trigrams.values()) > MAX_NGRAM_REPEATS:
        return True
    content = [w for w in tokens if w not in STOP_WORDS]
    if len(tokens) >= 6 and content:
        return max(Counter(content).values()) / len(tokens) > MAX_WORD_SHARE
    return False


def echoes_prompt(text: str, prompt: str) -> bool:
    """True if the caption is, or begins with, the prompt's words (the model repeated its instruction)."""
    said, asked = words(text), words(prompt)
    return bool(asked) and said[: len(asked)] == asked


def judge(text: str, prompt: str, token_count: int, max_tokens: int = 77) -> str | None:
    """Why ``text`` cannot replace the original caption (one of :data:`REASONS`), or ``None`` if it can."""
    if not words(text):
        return EMPTY
    if echoes_prompt(text, prompt):
        return PROMPT_ECHO
    if is_repetitive(text):
        return REPETITION
    if token_count > max_tokens:
        return TOO_LONG
    return None
