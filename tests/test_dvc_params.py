"""Every param a dvc.yaml stage lists exists in every params file the project ships: DVC refuses to run a stage
whose listed key a file leaves out ("Parameters ... are missing from 'params.yaml'"), even where the typed config
has a default. The full configuration met this in ``make preflight`` (eval_grid's ``demo.*`` keys)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PARAMS_FILES = ["params.yaml", "configs/full/params.yaml"]
_MISSING = object()


def _lookup(data, dotted: str):
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return _MISSING
        data = data[part]
    return data


def listed_params(params: dict) -> list[tuple[str, str]]:
    """``(stage@item, param path)`` for every param of every stage, ``${key}`` filled in for each item."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    out = []
    for name, stage in stages.items():
        if "foreach" in stage:
            collection = _lookup(params, stage["foreach"].strip("${}"))
            items = list(collection) if isinstance(collection, dict) else []
            body = stage["do"]
        else:
            items, body = [None], stage
        for entry in body.get("params", []):
            keys = entry if isinstance(entry, str) else None
            if keys is None:  # {file: [keys]}: another file's params
                continue
            for item in items:
                out.append((f"{name}@{item}" if item else name, keys.replace("${key}", str(item))))
    return out


@pytest.mark.parametrize("params_file", PARAMS_FILES)
def test_every_param_a_stage_lists_is_in_the_params_file(params_file):
    params = yaml.safe_load((REPO / params_file).read_text())
    listed = listed_params(params)
    missing = [f"{stage}: {key}" for stage, key in listed if _lookup(params, key) is _MISSING]
    assert len(listed) > 50 and not missing, f"{params_file} lacks keys dvc.yaml stages list: {missing}"
