"""Where ``sdforge export`` may write, checked before anything heavy is imported or loaded (a refused ``--out``
answers in well under a second): not a workspace folder, not one containing the workspace, not a folder of
someone else's files (docs/RESILIENCE.md "What deletes what"). :mod:`sdforge.eval.export` writes the folder."""

from __future__ import annotations

from pathlib import Path

from sdforge.config import Params
from sdforge.output_dirs import check_replaceable, refuse_workspace_target, resolved, workspace_folders

EXPORT_MARKER = "sdforge_export.json"
"""The export's metrics, written last into the folder: what proves a folder to be a previous export."""


def check_workspace_target(out_dir: Path, params: Params, params_file: Path, checkpoint_dir: Path) -> None:
    """:class:`~sdforge.io.InputError` when ``out_dir`` overlaps a ``params.paths`` folder (checkpoints, runs,
    data, models, eval, …) or the ``checkpoint_dir`` read, or contains the workspace (the params file's folder, the
    current directory)."""
    workspaces = [Path.cwd(), resolved(params_file).parent]
    folders = {f"the workspace folder {k}": v for k, v in workspace_folders(params.paths, workspaces).items()}
    folders[f"--checkpoint {checkpoint_dir}"] = resolved(checkpoint_dir)
    refuse_workspace_target(out_dir, "--out", folders, workspaces)


def check_export_target(
    out_dir: Path, params: Params, params_file: Path, checkpoint_dir: Path, overwrite: bool
) -> None:
    """:func:`check_workspace_target`, then ``out_dir`` must be new, an empty folder or — with ``overwrite`` — a
    previous export (its :data:`EXPORT_MARKER`); an :class:`~sdforge.io.InputError` naming it otherwise."""
    check_workspace_target(out_dir, params, params_file, checkpoint_dir)
    check_replaceable(out_dir, EXPORT_MARKER, "export", "--out", overwrite)
