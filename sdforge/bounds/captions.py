"""Captions bounded at the door: cut to ``sources.<s>.fetch.max_caption_chars`` before they cost memory.

CLIP reads 77 tokens; a caption of millions of characters is tokenized whole before it is cut (the Rust tokenizer
aborts the process near 60 MB) and would be stored in every copy downstream. So the filter stage cuts each
caption to the limit and records ``caption_truncated``; fetch, encode and the recaption stage cut again what
they read (a shard or caption store from elsewhere), and a side file is read only as far as the limit can use.
The default, 4,096 characters, is more than 10× what 77 CLIP tokens of English use (~300-400 characters) and
covers the long-prompt schemes that chunk a caption into 3 × 77 tokens. docs/INPUTS.md lists where each cut is.

A UTF-8 byte-order mark at the start (Windows editors write one) is not part of the caption: it is dropped here,
as the JSON reader (:mod:`sdforge.bounds.json_docs`) drops it, so a ``.txt`` and a ``.json`` caption read alike.
"""

from __future__ import annotations

import codecs
from pathlib import Path

UTF8_MAX_BYTES_PER_CHAR = 4
UTF8_BOM = codecs.BOM_UTF8


def cut_caption(text: str, max_chars: int | None) -> tuple[str, bool]:
    """``text`` cut to ``max_chars`` characters (None: unbounded) and whether it was cut."""
    if max_chars is None or len(text) <= max_chars:
        return text, False
    return text[:max_chars], True


def decode_caption(data: bytes, max_chars: int | None) -> tuple[str, bool]:
    """UTF-8 ``data`` (invalid bytes replaced) as a caption of at most ``max_chars`` characters, and whether it
    was cut; only the bytes that can make ``max_chars`` characters are decoded. A leading BOM is dropped."""
    data = data.removeprefix(UTF8_BOM)
    if max_chars is not None and len(data) > max_chars * UTF8_MAX_BYTES_PER_CHAR:
        text = data[: max_chars * UTF8_MAX_BYTES_PER_CHAR].decode("utf-8", errors="replace")
        return text[:max_chars], True
    return cut_caption(data.decode("utf-8", errors="replace"), max_chars)


def read_caption_file(path: Path, max_chars: int | None) -> tuple[str, bool]:
    """The strict-UTF-8 text of ``path`` cut to ``max_chars`` characters, reading at most the bytes those can
    take (a 100 MB ``.txt`` costs 16 KiB), and whether it was cut. Raises ``UnicodeDecodeError`` / ``OSError``.
    A multi-byte character split by the read limit is dropped, not an error; a leading BOM is dropped."""
    if max_chars is None:
        return path.read_text(encoding="utf-8-sig"), False
    limit = max_chars * UTF8_MAX_BYTES_PER_CHAR
    with path.open("rb") as f:
        data = f.read(len(UTF8_BOM) + limit + 1).removeprefix(UTF8_BOM)
    if len(data) <= limit:
        return cut_caption(data.decode("utf-8"), max_chars)
    try:
        text = data[:limit].decode("utf-8")
    except UnicodeDecodeError as err:  # a character cut by the read limit is dropped; anything else is an error
        if err.start < limit - UTF8_MAX_BYTES_PER_CHAR:
            raise
        text = data[: err.start].decode("utf-8")
    return text[:max_chars], True
