"""JSON from data files, parsed within limits (``sources.<s>.inputs``: :class:`sdforge.config.InputLimits`).

The parser is the standard library's: its C scanner raises ``RecursionError`` past the interpreter's recursion
limit (~1,000 levels) after reading at most that many bytes, with no memory growth, and it reads ``NaN`` and
``Infinity`` as the Python-written dumps of these datasets contain them (orjson, the fastest well-kept
alternative, has a fixed 1,024-level limit but rejects both, which would drop rows that parse today). On top:

- the document's size is checked before it is parsed (``json_max_bytes``);
- the parser's recursion error becomes a :class:`JsonLimitError` (``json_too_deep``);
- an iterative walk of the parsed value checks ``json_max_depth`` and ``json_max_entries`` (values in all its
  arrays and objects), so nothing downstream that recurses into a value (``json.dumps`` of a row's meta) can
  meet a document deeper than the configured depth.

:class:`JsonLimitError` is a ``ValueError``: a caller that already counts an unreadable record as dropped counts
one over a limit the same way; its ``reason`` names the limit for the stage's metrics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sdforge.config import InputLimits

TOO_DEEP, TOO_LARGE, TOO_MANY_ENTRIES = "json_too_deep", "json_too_large", "json_too_many_entries"
REASONS = (TOO_DEEP, TOO_LARGE, TOO_MANY_ENTRIES)
"""The limits a document can break, as drop reasons."""

DEFAULT_LIMITS = InputLimits()
"""The documented defaults (a source without an ``inputs`` section)."""

_KEYS = {TOO_DEEP: "json_max_depth", TOO_LARGE: "json_max_bytes", TOO_MANY_ENTRIES: "json_max_entries"}


class JsonLimitError(ValueError):
    """A JSON document over one of :data:`REASONS`; the message names the limit and the key that raises it."""

    def __init__(self, reason: str, detail: str, limits: InputLimits):
        key = _KEYS[reason]
        super().__init__(f"{detail} (sources.<source>.inputs.{key}: {getattr(limits, key)}; raise it if the file "
                         "is genuine)")  # fmt: skip
        self.reason = reason


def loads(data: bytes | str, limits: InputLimits) -> Any:
    """``data`` parsed as one JSON document within ``limits``; :class:`JsonLimitError` over one, ``ValueError``
    (``json.JSONDecodeError``, ``UnicodeDecodeError``) when it is not JSON. A leading UTF-8 BOM is skipped (the
    parser does so for bytes, not for text), as :mod:`sdforge.bounds.captions` skips it."""
    if isinstance(data, str):
        data = data.removeprefix("\ufeff")
    size = len(data)
    if size > limits.json_max_bytes:
        raise JsonLimitError(TOO_LARGE, f"JSON document of {size:,} bytes", limits)
    try:
        value = json.loads(data)
    except RecursionError:
        raise JsonLimitError(TOO_DEEP, "JSON nested deeper than the parser's recursion limit", limits) from None
    check(value, limits)
    return value


def load_file(path: Path, limits: InputLimits) -> Any:
    """File ``path`` parsed as one JSON document within ``limits``, its size checked before it is read."""
    size = path.stat().st_size
    if size > limits.json_max_bytes:
        raise JsonLimitError(TOO_LARGE, f"{size:,}-byte JSON file", limits)
    return loads(path.read_bytes(), limits)


def check(value: Any, limits: InputLimits) -> None:
    """:class:`JsonLimitError` when parsed ``value`` nests deeper than ``json_max_depth`` or holds more than
    ``json_max_entries`` values in its arrays and objects (an iterative walk: no recursion)."""
    entries, level, todo = 0, 1, [value] if isinstance(value, dict | list) else []
    while todo:
        children = []
        for node in todo:
            items = node.values() if isinstance(node, dict) else node
            entries += len(items)
            children += [c for c in items if isinstance(c, dict | list)]
        if entries > limits.json_max_entries:
            raise JsonLimitError(TOO_MANY_ENTRIES, f"JSON document with more than {entries:,} values", limits)
        if children and level >= limits.json_max_depth:
            raise JsonLimitError(TOO_DEEP, f"JSON nested deeper than {level} levels", limits)
        todo, level = children, level + 1
