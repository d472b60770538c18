"""Numbers in params (issue 55, item 3): ``sdforge check`` and every params load refuse a non-finite float
(``.inf``, ``.nan``) and a boolean where a number is meant (``batch_size: true``), naming the key path; a field
that admits a boolean keeps it."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Annotated

import pytest
import yaml
from pydantic import Field

from sdforge.config import ConfigError, load_params
from sdforge.config.base import bool_for_number
from sdforge.config.sources import Recaption
from tools.check_params import check

REPO = Path(__file__).resolve().parents[2]


def params_with(tmp_path: Path, section: str, key: str, value) -> Path:
    """The demo params.yaml with ``section.key`` (``phases.phase1.mix`` style: dotted) set to ``value``."""
    data = yaml.safe_load((REPO / "params.yaml").read_text())
    node = data
    for part in section.split("."):
        node = node[part]
    node[key] = value
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("eval", "guidance_scale", math.inf, "eval.guidance_scale: Input should be a finite number (got inf)"),
        ("eval", "guidance_scale", -math.inf, "eval.guidance_scale: Input should be a finite number (got -inf)"),
        ("eval", "guidance_scale", math.nan, "eval.guidance_scale: Input should be a finite number (got nan)"),
        ("phases.phase1", "lr", math.nan, "phases.phase1.lr: Input should be a finite number (got nan)"),
        (
            "sources.laion.filter",
            "min_aesthetic",
            math.inf,
            "sources.laion.filter.min_aesthetic: Input should be a finite number (got inf)",
        ),  # fmt: skip
        (
            "eval",
            "batch_size",
            True,
            "eval.batch_size: expected a number, got a boolean (true/false): write the number (got True)",
        ),  # fmt: skip
        ("eval", "guidance_scale", True, "eval.guidance_scale: expected a number, got a boolean"),
        ("train", "seed", False, "train.seed: expected a number, got a boolean"),
        ("eval", "extra_sizes", [[True, 32]], "eval.extra_sizes: expected a number, got a boolean"),
        ("phases.phase1", "mix", {"laion": True}, "phases.phase1.mix: expected a number, got a boolean"),
    ],
)
def test_sdforge_check_refuses_non_finite_floats_and_booleans_for_numbers_naming_the_key(
    tmp_path, caplog, section, key, value, message
):
    path = params_with(tmp_path, section, key, value)
    with caplog.at_level(logging.ERROR):
        assert check(str(path)) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0], errors
    assert errors[0].startswith(f"{path}: {message}"), errors
    with pytest.raises(ConfigError, match=r"(finite number|got a boolean)"):
        load_params(path)


@pytest.mark.parametrize("spelling", [".inf", ".Inf", "-.inf", ".nan", ".NaN"])
def test_the_yaml_spellings_of_inf_and_nan_are_refused(tmp_path, spelling):
    path = params_with(tmp_path, "eval", "guidance_scale", "__X__")
    path.write_text(path.read_text().replace("__X__", spelling))
    with pytest.raises(ConfigError, match=r"eval.guidance_scale: Input should be a finite number"):
        load_params(path)


def test_a_boolean_where_the_type_admits_one_is_kept():
    recaption = Recaption(model="m", generation={"do_sample": False, "max_new_tokens": 8, "repetition_penalty": 1.2})
    assert recaption.generation == {"do_sample": False, "max_new_tokens": 8, "repetition_penalty": 1.2}


@pytest.mark.parametrize(
    ("annotation", "value", "refused"),
    [
        (int, True, True),
        (float | None, False, True),
        (Annotated[int, Field(ge=1)] | None, True, True),
        (int | bool, True, False),
        (bool, True, False),
        (str, True, False),
        (int, 1, False),
        (list[tuple[int, int]], [(1, True)], True),
        (list[tuple[int, int]], [(1, 2)], False),
        (dict[str, int | float], {"a": 1, "b": True}, True),
        (dict[str, int | float | bool], {"a": True}, False),
    ],
)
def test_bool_for_number(annotation, value, refused):
    assert bool_for_number(annotation, value) is refused
