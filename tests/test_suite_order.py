"""The suite's run order (tests/fixtures/suite.py) names real modules and puts them first."""

from __future__ import annotations

from pathlib import Path

from tests.fixtures.suite import HEAVIEST_FIRST, heaviest_first

REPO = Path(__file__).resolve().parents[1]


def test_every_heavy_module_named_exists():
    missing = [path for path in HEAVIEST_FIRST if not (REPO / path).is_file()]
    assert not missing, f"tests/fixtures/suite.py names modules that are gone (rename or drop them): {missing}"


def test_heavy_modules_go_first_in_their_order_and_the_rest_keep_theirs():
    ids = ["tests/a.py::x", "tests/stages/test_train.py::t1", "tests/b.py::y", "tests/test_e2e.py::e",
           "tests/stages/test_train.py::t2", "tests/a.py::z"]
    order = [ids[i] for i in heaviest_first(ids)]
    assert order == ["tests/test_e2e.py::e", "tests/stages/test_train.py::t1", "tests/stages/test_train.py::t2",
                     "tests/a.py::x", "tests/b.py::y", "tests/a.py::z"]
