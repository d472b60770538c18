"""``tools.check_params`` (``sdforge check``, run by ``make demo`` before ``dvc repro``): a params file DVC would
choke on — an alias bomb (DVC 3.67 itself: 2 min, 5.9 GB, SIGABRT) or a phase named ``..`` — is refused with one
line naming it; the shipped params files pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.fixtures.params_bombs import alias_bomb
from tools.check_params import check

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["params.yaml", "configs/full/params.yaml"])
def test_the_shipped_params_files_pass(name):
    assert check(str(REPO / name)) == 0


def test_an_alias_bomb_and_a_hostile_phase_name_are_refused_with_their_reason(tmp_path, caplog):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text((REPO / "params.yaml").read_text() + alias_bomb())
    assert check(str(bomb)) == 2  # refused before it is built (DVC's own parse of it ran 2 min, then aborted)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["phases"][".."] = next(iter(params["phases"].values()))
    named = tmp_path / "named.yaml"
    named.write_text(yaml.safe_dump(params))
    assert check(str(named)) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "alias bomb" in errors[0] and "'..'" in errors[1], errors
