"""Folders a command writes on a path the user typed (``sdforge export --out``, ``preflight --out``).

The rule (docs/RESILIENCE.md, "What deletes what"): a command replaces only what it wrote itself — a path
that is absent, an empty folder, or a folder holding the command's own marker file — and never a folder of
the workspace (``params.paths``) or one that contains the workspace. Paths are compared resolved (``~``,
symlinks and ``..`` followed), so a detour through a link or ``..`` names the same folder.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from sdforge.config.paths import Paths
from sdforge.io import InputError

log = logging.getLogger(__name__)


def resolved(path: str | Path) -> Path:
    """``path`` absolute, with ``~``, symlinks and ``..`` resolved (the parts that do not exist yet kept)."""
    return Path(path).expanduser().resolve()


def overlaps(a: Path, b: Path) -> bool:
    """``a`` is ``b``, lies inside it or contains it (both already resolved)."""
    return a == b or a in b.parents or b in a.parents


def workspace_folders(paths: Paths, roots: Iterable[Path]) -> dict[str, Path]:
    """Every ``paths.<key>`` folder and the folders holding it inside a workspace (``data/`` for
    ``data/shards``), resolved, by name: an absolute value as is, a relative one from each of ``roots`` (the stages
    take them from the current directory; a user may also mean the params file's folder)."""
    folders = {}
    for key in type(paths).model_fields:
        value = Path(getattr(paths, key)).expanduser()
        for root in map(resolved, roots):
            folder = resolved(root / value)  # an absolute value stays itself
            folders[f"paths.{key} ({folder})"] = folder
            for holder in folder.parents:
                if root not in holder.parents:
                    break
                if holder not in folders.values():
                    folders[f"{holder} (it holds paths.{key})"] = holder
    return folders


def refuse_workspace_target(out: Path, flag: str, folders: Mapping[str, Path], workspaces: Iterable[Path]) -> None:
    """:class:`InputError` when ``out`` contains one of ``workspaces``, or is, lies inside or contains one of
    ``folders`` (name → resolved folder; the one named: the deepest that holds ``out``, else the first it holds):
    writing there could replace what they hold."""
    target = resolved(out)
    for workspace in map(resolved, workspaces):
        if target == workspace or target in workspace.parents:
            raise InputError(f"{flag} {out}: contains the workspace {workspace}; pick a folder inside it or beside it")
    hits = sorted((folder, name) for name, folder in folders.items() if overlaps(target, folder))
    hits.sort(key=lambda hit: (0, -len(hit[0].parts)) if target.is_relative_to(hit[0]) else (1, len(hit[0].parts)))
    if hits:
        raise InputError(
            f"{flag} {out}: overlaps {hits[0][1]}; writing there could replace what it holds: pick a folder outside it "
            "(e.g. exports/<name>)"
        )


def check_replaceable(out: Path, marker: str, what: str, flag: str, overwrite: bool | None) -> bool:
    """Whether ``out`` holds a previous ``what`` to replace (it has ``marker``); False when it is absent or an
    empty folder. Anything else is an :class:`InputError` naming ``out``, and nothing is written: a file, a
    folder with other content, and — unless ``overwrite`` (None: no such flag, replacing is the command's
    documented behaviour) — a previous ``what``."""
    if not out.exists():
        if out.is_symlink():
            raise InputError(f"{flag} {out}: a dangling symlink; remove it or pick another folder")
        return False
    if not out.is_dir():
        raise InputError(f"{flag} {out}: exists and is not a folder; pick a new folder name")
    if not any(out.iterdir()):
        return False
    if not (out / marker).is_file():
        raise InputError(
            f"{flag} {out}: a folder with files that are not a previous {what} (no {marker} in it); nothing "
            "was written: pick a new or empty folder"
        )
    if overwrite is False:
        raise InputError(f"{flag} {out}: holds a previous {what}; pass --overwrite to replace it, or pick a new folder")
    return True


def unexpected_entries(folder: Path, allowed: Iterable[str]) -> list[str]:
    """The names at the top of ``folder`` that are not in ``allowed`` (sorted)."""
    allowed = set(allowed)
    return sorted(p.name for p in folder.iterdir() if p.name not in allowed)


def fresh_sibling(out: Path, tag: str) -> Path:
    """A new, empty folder ``.<out name>.<tag>-<random>`` beside ``out`` (its parents created), made with the
    process's umask like any folder the command writes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    path = out.with_name(f".{out.name}.{tag}-{secrets.token_hex(4)}")
    path.mkdir()  # never an existing folder: mkdir refuses one
    return path


def warn_leftovers(out: Path, tags: Iterable[str]) -> list[Path]:
    """Warn about (never delete) the ``.<out name>.<tag>-*`` folders a killed run left beside ``out``."""
    found = sorted(p for tag in tags for p in out.parent.glob(f".{out.name}.{tag}-*")) if out.parent.is_dir() else []
    if found:
        log.warning(
            "%s: left by a killed run beside it (kept; remove them when nothing runs): %s",
            out,
            ", ".join(p.name for p in found),
        )
    return found


def check_scratch_dir(out: Path, marker: str, what: str, code_root: Path, code_folders: Iterable[str]) -> bool:
    """Whether ``out``, a tool's scratch workspace (``preflight --out``), holds a previous one (``marker``) to
    reuse or replace. An :class:`InputError` when it contains ``code_root`` or the current directory, overlaps
    one of ``code_root``'s ``code_folders`` (which the tool copies into it), or is a file or a folder with other
    content."""
    folders = {f"the project's {name}": resolved(code_root / name) for name in code_folders}
    refuse_workspace_target(out, "--out", folders, [code_root, Path.cwd()])
    return check_replaceable(out, marker, what, "--out", overwrite=None)


def mark_scratch_dir(out: Path, marker: str, what: str) -> None:
    """Create ``out`` if needed and write its ``marker`` (what proves it to be ``what`` to a later run)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / marker).write_text(f"{what}: written by sdforge; the folder is replaced or reused by its next run\n")


def move_aside(path: Path, why: str) -> Path:
    """Rename ``path`` to a new ``<name>.moved-<UTC time>[-n]`` beside it and warn, naming ``why`` and where it
    went: what a stage finds in its output folder but did not write is kept, never deleted."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = path.with_name(f"{path.name}.moved-{stamp}")
    n = 1
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}.moved-{stamp}-{n}")
    path.rename(target)
    log.warning("%s: %s; moved to %s (nothing deleted: remove it when sure)", path, why, target)
    return target
