"""Paths read from a data folder, whose symlinks a user or a data dump controls."""

from __future__ import annotations

from pathlib import Path


def resolved(path: Path) -> Path | None:
    """``path`` with every symlink followed, or None where that cannot end: a symlink loop (``a → b → a``;
    ``Path.resolve`` raises ``RuntimeError`` on Python 3.11, ``OSError`` on later ones) or an unreadable link."""
    try:
        return path.resolve()
    except (RuntimeError, OSError):
        return None


def resolves_inside(path: Path, root: Path) -> bool:
    """``path``, symlinks followed, is ``root`` (resolved) or below it; False for a loop."""
    target, base = resolved(path), resolved(root)
    return target is not None and base is not None and target.is_relative_to(base)


def resolves_to_file(path: Path) -> bool:
    """``path``, symlinks followed, is a regular file; False for a loop or a dangling link."""
    target = resolved(path)
    return target is not None and target.is_file()
